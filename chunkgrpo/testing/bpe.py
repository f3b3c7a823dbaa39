"""Byte-level BPE helpers shared by the offline tokenizer builders (tiny FLUX, tiny CLIP)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte → printable unicode map (256 entries; the public algorithm)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
