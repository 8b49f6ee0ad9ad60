"""``predict.py`` (``wds-predict``): a trained model's top-k classes for image files, folders or
shards, with the class names, as a table, CSV or JSON lines; or the model exported to ONNX.

    predict.py outputs/RUN ~/photos/new/                 # a table, top 5
    predict.py outputs/RUN a.jpg b.png --format jsonl --top-k 3
    predict.py outputs/RUN/latest.pt 'data/val-{000000..000003}.tar' --format csv
    predict.py outputs/RUN --export onnx                 # RUN/model.onnx, checked against torch
    torchrun --nproc_per_node=8 predict.py outputs/RUN 'SPEC' --out-dir DIR   # a whole data set (predict_job.py)

The model: a run directory or a folder with model.safetensors and config.json (what every run
writes when it ends), else its latest checkpoint; or a checkpoint file. Preprocessing is the
evaluation's (wdsdist.data.decode_eval: the same functions as the evaluation loader). An image
that cannot be read is named on stderr and skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import fields

import torch

from wdsdist.data import DataError, EvalLoader, LoaderConfig, UserError, decode_eval
from wdsdist.errors import CliParser, integer, run_cli
from wdsdist.model.classify import Classifier, load_model, top_k
from wdsdist.predict.options import PredictOptions
from wdsdist.predict.parts import write
from wdsdist.predict.read import image_files, is_shards


def batches(inputs: Sequence[str], cfg: LoaderConfig, skipped: list[str]) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(names, uint8 images) batches: files decoded here, shards read by the evaluation loader."""
    names, images = [], []
    for item in inputs:
        if is_shards(item):
            for batch in EvalLoader(item, cfg, rank=0, world=1):
                yield [f"{item}#{key}" for key in batch["key"]], batch["image"]
            continue
        for path in image_files([item]):
            try:
                with open(path, "rb") as f:
                    images.append(decode_eval(f.read(), cfg, path))
                names.append(path)
            except (OSError, DataError) as exc:
                skipped.append(path)
                print(f"predict: {exc if isinstance(exc, DataError) else f'{path}: {exc}'}; skipped", file=sys.stderr)
            if len(images) == cfg.batch_size:
                yield names, torch.stack(images)
                names, images = [], []
    if images:
        yield names, torch.stack(images)


def export_onnx(model: Classifier, config: dict, out: str) -> float | None:
    """The model (normalisation inside: 0-255 float images in) as ONNX at ``out``; the largest
    difference from torch's logits through onnxruntime on random images, where it is installed."""
    size = config["image_size"]
    sample = torch.rand(2, 3, size, size) * 255
    try:
        torch.onnx.export(
            model, (sample,), out, input_names=["image"], output_names=["logits"],
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False,
        )  # fmt: skip
    except ImportError as exc:
        raise UserError(f"--export onnx: {exc} (pip install 'wds-distributed[onnx]')") from None
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(out, providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"image": sample.numpy()})[0]
    with torch.no_grad():
        want = model(sample)
    return float((torch.from_numpy(got) - want).abs().max())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = CliParser(prog="predict.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a run directory, a folder with model.safetensors + config.json, or a checkpoint")
    p.add_argument("inputs", nargs="*", help="image files, folders, or shard specs (index JSON, tar patterns)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--format", choices=["table", "csv", "jsonl"], default="table")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto (a GPU where there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--export", choices=["onnx"], help="write the model as ONNX instead of predicting")
    p.add_argument("--out", help="the ONNX file (default MODEL/model.onnx); or the predictions' file (default stdout)")
    job = p.add_argument_group("a whole data set, on every rank of a torchrun job (--out-dir)")
    job.add_argument("--out-dir", help="one part per input shard here, restartable; --out: the parts joined")
    job.add_argument("--workers", default="auto", help="loader workers per rank: a number, or auto")
    job.add_argument("--decode", choices=["cpu", "gpu", "auto"], default="cpu", help="where JPEGs are decoded")
    job.add_argument("--features", action="store_true", help="also each sample's penultimate features (.npy)")
    job.add_argument("--part-size", type=integer(1), default=1000, help="folders: images per part")
    job.add_argument("--strict", action="store_true", help="a missing or truncated shard stops the job")
    job.add_argument("--write-shards", help="each input shard again here, pred.json (and emb.npy) beside each sample")
    job.add_argument("--cache-dir", help="a node cache for remote shards (loader.cache_dir)")
    return p.parse_args(argv)


def options(argv: list[str] | None) -> PredictOptions:
    """The command line, parsed and typed: what every step below reads."""
    parsed = vars(parse_args(argv))
    return PredictOptions(**{f.name: parsed[f.name] for f in fields(PredictOptions)})


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    if opts.whole_data_set:
        if not opts.inputs:
            raise UserError("predict.py --out-dir: give the shard specs or folders to classify")
        from wdsdist.predict.job import run_job

        line, status = run_job(opts)
        if line:
            print(line, file=sys.stderr)
        return status
    model, config = load_model(opts.model)
    if opts.export:
        folder = opts.model if os.path.isdir(opts.model) else os.path.dirname(opts.model)
        out = opts.out or os.path.join(folder, "model.onnx")
        diff = export_onnx(model, config, out)
        checked = f"; onnxruntime's logits within {diff:.2e} of torch's" if diff is not None else ""
        print(f"wrote {out}{checked}", file=sys.stderr)
        return 0
    if not opts.inputs:
        raise UserError("predict.py: give image files, folders or shard specs to classify")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if opts.device == "auto" else opts.device)
    model = model.to(device)
    size, resize = config["image_size"], config.get("resize")  # evaluation's crop and resize (config.json)
    cfg = LoaderConfig(
        batch_size=opts.batch_size, image_size=size, eval_resize=resize, train=False, workers=0, with_keys=True
    )
    from tqdm import tqdm

    rows, skipped = [], []
    with torch.no_grad(), tqdm(unit="image", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        for names, images in batches(opts.inputs, cfg, skipped):
            logits = model(images.to(device).float())
            rows += zip(names, top_k(logits.cpu(), config["classes"], opts.top_k), strict=True)
            bar.update(len(names))
    out = open(opts.out, "w", newline="", encoding="utf-8") if opts.out else sys.stdout  # noqa: SIM115
    try:
        write(rows, opts.format, out)
    finally:
        if opts.out:
            out.close()
    print(f"predict: {len(rows)} images classified" + (f", {len(skipped)} skipped" if skipped else ""), file=sys.stderr)
    return 0 if rows or not skipped else 1


def run() -> None:
    """The console script (wds-predict): one-line errors (wdsdist.errors.run_cli)."""
    run_cli(main)
