"""Small replicas of how ImageNet is handed out, for wds-makeshards' tests: a train tar of class
tars (ILSVRC2012_img_train.tar holding n01440764.tar holding n01440764_10026.JPEG), a flat val tar
(ILSVRC2012_img_val.tar), its labels as a CSV, as Kaggle's LOC_val_solution.csv and as the
devkit's ground truth with the devkit's own class order; and the damaged files ImageNet and the
users' own folders hold."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

WNIDS = ["n01440764", "n01443537", "n01484850"]
DEVKIT_ORDER = ["n01484850", "n01440764", "n01443537"]  # not sorted, as the devkit's is not
VAL_CLASSES = [0, 1, 1, 2, 2, 2, 0, 2, 1, 2]  # unequal counts: a wrong mapping shows in them


def image(seed: int, size: int = 32, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size, size + 8, len(mode)), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels if len(mode) > 1 else pixels[..., 0], mode=mode).save(out, format=fmt, quality=90)
    return out.getvalue()


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_600_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def train_tar(path: Path, per_class: int = 8, folders: bool = False) -> dict[str, int]:
    """A tar of class tars (or, ``folders``, of class folders); {member name: label}."""
    outer, labels = {}, {}
    for label, wnid in enumerate(WNIDS):
        images = {f"{wnid}_{10026 + i}.JPEG": image(100 * label + i) for i in range(per_class)}
        labels |= {f"{wnid}/{name}": label for name in images}
        if folders:
            outer |= {f"train/{wnid}/{name}": data for name, data in images.items()}
        else:
            outer[f"{wnid}.tar"] = tar_bytes(images)
    path.write_bytes(tar_bytes(outer))
    return labels


def val_name(i: int) -> str:
    return f"ILSVRC2012_val_{i:08d}"


def val_tar(path: Path) -> None:
    path.write_bytes(tar_bytes({f"{val_name(i)}.JPEG": image(1000 + i) for i in range(1, len(VAL_CLASSES) + 1)}))


def val_labels(folder: Path) -> dict[str, Path]:
    """The val labels in the three forms, and the devkit's class list: {form: path}."""
    rows = [(val_name(i), WNIDS[c]) for i, c in enumerate(VAL_CLASSES, 1)]
    csv = folder / "val.csv"
    csv.write_text("name,class\n" + "".join(f"{name}.JPEG,{wnid}\n" for name, wnid in rows))
    kaggle = folder / "LOC_val_solution.csv"
    kaggle.write_text("ImageId,PredictionString\n" + "".join(f"{n},{w} 10 20 30 40 {w} 1 2 3 4\n" for n, w in rows))
    truth = folder / "ILSVRC2012_validation_ground_truth.txt"
    truth.write_text("".join(f"{DEVKIT_ORDER.index(w) + 1}\n" for _, w in rows))
    synsets = folder / "devkit-synsets.txt"
    synsets.write_text("".join(f"{w}\n" for w in DEVKIT_ORDER))
    return {"csv": csv, "kaggle": kaggle, "devkit": truth, "synsets": synsets}


def cmyk_jpeg(seed: int) -> bytes:
    return image(seed, mode="CMYK")


def bad_files(folder: Path) -> dict[str, bytes]:
    """The files of issue 64's report, in one class folder: {name: bytes} of the two that are
    images (a CMYK JPEG and a PNG named .JPEG); the text, empty and truncated ones beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    good = {"cmyk.JPEG": cmyk_jpeg(7), "png_named.JPEG": image(8, fmt="PNG")}
    for name, data in good.items():
        (folder / name).write_bytes(data)
    (folder / "notes.jpg").write_text("this is a text file named like an image\n")
    (folder / "empty.jpg").write_bytes(b"")
    whole = image(9, size=64)
    (folder / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    return good
