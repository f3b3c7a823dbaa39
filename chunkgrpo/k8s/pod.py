"""Commands the training container runs around torchrun (`JobSpec.container_command` writes them):

    python -m chunkgrpo.k8s.pod fetch s3://bucket/key LOCAL_PATH              # before torchrun
    python -m chunkgrpo.k8s.pod upload-final LOCAL_DIR s3://bucket/prefix      # node rank 0, after it

`upload-final` uploads `<output_dir>/final` (an exported model: `chunkgrpo_model.json` must exist) with
`ArtifactStore.put_folder` (manifest last) and `train_summary.json` beside it, so the final model
leaves the pod before the job ends.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from chunkgrpo.store.client import ArtifactStore


def _upload_final(local_dir: str, uri: str) -> None:
    """Node-rank-0 step of the training container: upload `<output_dir>/final` (manifest last)."""
    final = Path(local_dir)
    if not (final / "chunkgrpo_model.json").exists():
        raise SystemExit(f"upload-final: {final} holds no exported model (chunkgrpo_model.json missing)")
    summary = final.parent / "train_summary.json"
    m = ArtifactStore().put_folder(final, uri, meta={"kind": "model"})
    if summary.exists():
        ArtifactStore().put_file(summary, uri.rstrip("/") + ".train_summary.json")
    print(f"uploaded {final} -> {uri} (manifest sha256 {m.sha256})", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 3 and argv[0] in ("upload-final", "fetch"):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        if argv[0] == "upload-final":
            _upload_final(argv[1], argv[2])
        else:
            Path(argv[2]).parent.mkdir(parents=True, exist_ok=True)
            ArtifactStore().get_file(argv[1], argv[2])
        return 0
    print("usage: python -m chunkgrpo.k8s.pod upload-final LOCAL_DIR s3://bucket/prefix\n"
          "       python -m chunkgrpo.k8s.pod fetch s3://bucket/key LOCAL_PATH", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
