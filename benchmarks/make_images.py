"""Writes configs/data/shapes.npz: small noisy images of four shapes, for configs/cnn.sx.

Each image is 12x12, one channel, uint8 (0..255): a horizontal bar, a vertical bar,
a cross or a hollow square, of a random size and place, with a random brightness
over uniform noise. `x` is [N, 12, 12, 1] uint8, `y` [N] int32 (the class, in that
order). The file is a pure function of --seed: running the script again writes the
same bytes.

  python benchmarks/make_images.py [--seed 0] [--count 1200] [-o configs/data/shapes.npz]
"""

from __future__ import annotations

import argparse
import io
import os
import zipfile

import numpy as np

SIZE = 12
CLASSES = ("horizontal bar", "vertical bar", "cross", "hollow square")


def draw(kind: int, rng: np.random.Generator) -> np.ndarray:
  """One [12, 12] float image in [0, 1] of class `kind`."""
  img = np.zeros((SIZE, SIZE), np.float32)
  n = int(rng.integers(5, 10))  # the shape's extent
  r, c = (int(v) for v in rng.integers(0, SIZE - n + 1, size=2))
  t = int(rng.integers(1, 3))  # stroke thickness
  mid = n // 2 - t // 2
  if kind == 0:
    img[r + mid:r + mid + t, c:c + n] = 1.0
  elif kind == 1:
    img[r:r + n, c + mid:c + mid + t] = 1.0
  elif kind == 2:
    img[r + mid:r + mid + t, c:c + n] = 1.0
    img[r:r + n, c + mid:c + mid + t] = 1.0
  else:
    img[r:r + n, c:c + n] = 1.0
    img[r + t:r + n - t, c + t:c + n - t] = 0.0
  bright = rng.uniform(0.55, 0.9)
  noise = rng.uniform(0.0, 0.35, size=img.shape)
  return np.clip(img * bright + noise, 0.0, 1.0)


def make(seed: int, count: int) -> dict[str, np.ndarray]:
  """`count` images, classes in a shuffled order, as {x uint8 [N,12,12,1], y int32 [N]}."""
  rng = np.random.default_rng(seed)
  y = rng.permutation(np.arange(count) % len(CLASSES)).astype(np.int32)
  # noise in 16 levels keeps the compressed file small; the shapes stay far above it
  x = np.stack([np.round(draw(int(k), rng) * 15) * 17 for k in y]).astype(np.uint8)
  return {"x": x[..., None], "y": y}


def write(path: str, arrays: dict[str, np.ndarray]) -> None:
  """A compressed .npz whose bytes depend only on the arrays (fixed zip timestamps)."""
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for name, a in arrays.items():
      buf = io.BytesIO()
      np.lib.format.write_array(buf, np.ascontiguousarray(a), allow_pickle=False)
      info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      z.writestr(info, buf.getvalue())


def main() -> None:
  here = os.path.dirname(os.path.abspath(__file__))
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--count", type=int, default=1200)
  ap.add_argument("-o", "--out", default=os.path.join(here, "..", "configs", "data",
                                                       "shapes.npz"))
  args = ap.parse_args()
  write(args.out, make(args.seed, args.count))
  print(f"{args.out}: {args.count} images of {SIZE}x{SIZE}, classes {', '.join(CLASSES)}, "
        f"{os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
  main()
