"""Scorer worker: one reward model, loaded once, scoring batches of images + prompts streamed over pipes.

    $CHUNKGRPO_VENV_HPSV3/bin/python -m chunkgrpo.scoring.worker hpsv3

The reward packages (hpsv2, image-reward, hpsv3) pin conflicting stacks, so each lives in its own venv
where chunkgrpo itself is NOT installed. This module (the protocol and the process loop) and
`chunkgrpo.scoring.backends` (the per-package model loaders) therefore import only the standard library,
numpy and PIL at import time, and torch + the scorer's package lazily; the parent
(`chunkgrpo.scoring.client`) puts a copy of these two files on the worker's PYTHONPATH. The same
backend classes run in-process when no venv is configured, so both paths share one implementation.

Protocol (the parent writes to stdin; replies go to the original stdout, and everything the packages
print is redirected to stderr, which the parent keeps in a log file):
  frame = 8-byte header (two big-endian uint32: JSON length, payload length) + JSON + payload bytes
  -> {"op": "load", "spec": {...}}                   <- {"op": "ready", "info": {...}, "runtime": {...}}
  -> {"op": "score", "prompts": [...], "shapes": [[h, w], ...]} + RGB uint8 pixels, images back to back
                                                     <- {"op": "scores", "n": k} + k float64 (little endian)
  -> {"op": "check", "spec": {...}}                  <- {"op": "checked", "problems": [...], "runtime": {...}}
  -> {"op": "exit"} (or EOF)
Any failure answers {"op": "error", "kind": "user" | "internal", "message": ..., "traceback": ...}; the
worker stays up after a failed request. It exits when the parent goes away (stdin EOF or re-parenting).
"""

from __future__ import annotations

import atexit
import gc
import inspect
import json
import os
import struct
import sys
import threading
import time
import traceback
from typing import Any, Sequence

import numpy as np
from PIL import Image

from chunkgrpo.scoring.backends import PACKAGES, Backend, SpecError, check, load_backend

PROTOCOL = 1
_FRAME = struct.Struct(">II")
PARENT_ENV = "CHUNKGRPO_WORKER_PARENT"

# --------------------------------------------------------------------------------------------------
# framing


def encode_frame(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header, allow_nan=True).encode()
    return _FRAME.pack(len(head), len(payload)) + head + payload


def read_exact(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError(f"stream closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(stream) -> tuple[dict, bytes]:
    nh, np_ = _FRAME.unpack(read_exact(stream, _FRAME.size))
    header = json.loads(read_exact(stream, nh))
    return header, read_exact(stream, np_) if np_ else b""


def pack_images(images: Sequence[Image.Image]) -> tuple[list[list[int]], bytes]:
    """RGB uint8 pixels back to back, with (h, w) per image."""
    shapes, parts = [], []
    for im in images:
        arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
        shapes.append([int(arr.shape[0]), int(arr.shape[1])])
        parts.append(np.ascontiguousarray(arr).tobytes())
    return shapes, b"".join(parts)


def unpack_images(shapes: Sequence[Sequence[int]], payload: bytes) -> list[Image.Image]:
    out, offset = [], 0
    for h, w in shapes:
        n = int(h) * int(w) * 3
        if offset + n > len(payload):
            raise ValueError(f"image payload too short: need {offset + n} bytes, got {len(payload)}")
        out.append(Image.fromarray(np.frombuffer(payload, np.uint8, n, offset).reshape(int(h), int(w), 3)))
        offset += n
    if offset != len(payload):
        raise ValueError(f"image payload has {len(payload) - offset} trailing bytes")
    return out


def runtime_info(name: str, backend: Backend | None = None) -> dict:
    """Where the scorer really runs: interpreter, package file and version, the model's class and its file."""
    import importlib.metadata as md

    module, dist = PACKAGES.get(name, (None, None))
    info: dict[str, Any] = {
        "python": sys.executable,
        "prefix": sys.prefix,
        "pid": os.getpid(),
        "protocol": PROTOCOL,
    }
    mod = sys.modules.get(module) if module else None
    if mod is not None:
        info["package"] = dist
        info["package_file"] = getattr(mod, "__file__", None)
        try:
            info["package_version"] = md.version(dist)
        except md.PackageNotFoundError:
            info["package_version"] = None
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
    if "torchvision" in sys.modules:  # its resize (antialias) shapes the pixels HPSv2 / open_clip score
        info["torchvision"] = sys.modules["torchvision"].__version__
    if backend is not None and backend.model is not None:
        cls = type(backend.model)
        info["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
        try:
            info["model_class_file"] = inspect.getfile(cls)
        except TypeError:
            info["model_class_file"] = None
    return info


# --------------------------------------------------------------------------------------------------
# the worker process


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (re-parented), even in the middle of a long forward pass."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def serve(name: str, inp, out) -> int:
    backend: Backend | None = None
    while True:
        try:
            header, payload = read_frame(inp)
        except EOFError:
            return 0
        op = header.get("op")
        body = b""
        try:
            if op == "exit":
                return 0
            if op == "check":
                reply = {"op": "checked", "problems": check(name), "runtime": runtime_info(name)}
            elif op == "load":
                backend = load_backend(name, header.get("spec") or {})
                reply = {"op": "ready", "info": backend.info, "runtime": runtime_info(name, backend)}
            elif op == "score":
                if backend is None:
                    raise RuntimeError("score before load")
                images = unpack_images(header["shapes"], payload)
                prompts = [str(p) for p in header["prompts"]]
                if len(prompts) != len(images):
                    raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
                scores = backend.score(images, prompts)
                body = np.ascontiguousarray(scores, dtype="<f8").tobytes()
                reply = {"op": "scores", "n": int(scores.shape[0])}
            else:
                raise ValueError(f"unknown op {op!r}")
        except SpecError as e:
            reply, body = {"op": "error", "kind": "user", "message": str(e)}, b""
        except Exception as e:
            reply, body = {"op": "error", "kind": "internal", "message": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc()}, b""
            traceback.print_exc(file=sys.stderr)
        out.write(encode_frame(reply, body))
        out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in PACKAGES:
        sys.stderr.write(f"usage: python -m chunkgrpo.scoring.worker <scorer>  "
                         f"(scorer: {', '.join(PACKAGES)})\n")
        return 2
    # Replies go to the original stdout; anything printed later (packages print) goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit():
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    # as chunkgrpo.startup and chunkgrpo.shutdown.fast_exit (this file runs without the package): full
    # collections 100× rarer while the reward stack loads; at exit one collection, then freeze, so the
    # teardown's repeated collections skip the reward stack's objects (the parent waits)
    if os.environ.get("CHUNKGRPO_GC", "").strip() != "default":
        gc.set_threshold(*gc.get_threshold()[:2], 1000)
    atexit.register(lambda: (gc.collect(), gc.freeze()))
    return serve(args[0], sys.stdin.buffer, out)


if __name__ == "__main__":
    sys.exit(main())
