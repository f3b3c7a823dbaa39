"""Image grids for MLflow and reports: `image_grid` tiles images with optional captions."""

from __future__ import annotations

from PIL import Image, ImageDraw


def image_grid(
    images: list[Image.Image], cols: int = 4, labels: list[str] | None = None, pad: int = 2
) -> Image.Image:
    """Tile images (all resized to the first one's size) into a grid, with optional captions."""
    if not images:
        raise ValueError("image_grid needs at least one image")
    w, h = images[0].size
    cols = max(1, min(cols, len(images)))
    rows = -(-len(images) // cols)
    label_h = 12 if labels else 0
    grid = Image.new("RGB", (cols * (w + pad) + pad, rows * (h + pad + label_h) + pad), "white")
    draw = ImageDraw.Draw(grid)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        x, y = pad + c * (w + pad), pad + r * (h + pad + label_h)
        grid.paste(im.convert("RGB").resize((w, h)), (x, y))
        if labels:
            draw.text((x, y + h), str(labels[i])[: max(4, w // 6)], fill="black")
    return grid
