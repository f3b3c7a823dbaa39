"""A learnable world on a CPU: synthetic compositional scenes, an exact GenEval-style detector and
reward, and a small FLUX-architecture model pretrained on them by flow matching.

- `chunkgrpo.toy.world`     scenes, captions (GenEval categories), the train / held-out split
- `chunkgrpo.toy.detector`  `ToyDetector` (a `geneval.Detector`), `ToyColorClassifier`, partial credit
- `chunkgrpo.toy.model`     build + pretrain the base model (diffusers FLUX folder), cached by content hash;
                            its parts: `toy.config`, `toy.components`, `toy.pretrain`, `toy.sampling`
"""
