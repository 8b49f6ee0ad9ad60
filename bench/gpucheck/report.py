"""gpu-check's report: the dated markdown (a table per part and what the numbers settle) and its
chart (samples/s per configuration beside pure compute), both from the results JSON alone."""

from __future__ import annotations

from pathlib import Path


def num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} x"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def note(row: dict) -> str:
    """A row's note: its error where it did not run as asked, else what it says of itself."""
    said = row.get("note", "") if row.get("status", "ok") == "ok" else f"{row['status']}: {row.get('error') or ''}"
    return said.replace("|", "/")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def cores(row: dict) -> str:
    return f"{num(row.get('cores_busy'), 1)} / {num(row.get('cores_busy_whole_run'), 1)}"


def data_table(part: dict) -> list[str]:
    rows = [
        [r["set"], num(r["images"]), num(r["shards"]), f"{r['mean_kb']:.0f} kB", seconds(r["seconds"])]
        for r in part["rows"]
    ]
    return table(["set", "images", "shards", "mean JPEG", "made and written in"], rows)


def default_table(part: dict) -> list[str]:
    after = part.get("steady_after", 0)
    header = ["run", "model, image, batch", "wall", "samples/s (run)", f"steady samples/s (after step {after})"]
    header += ["pure compute", "steady / pure", "data-wait (run / steady)", "val top-1", "cores busy (steady / run)"]
    header += ["workers", "note"]
    rows = [
        [
            f"`{r['run']}`",
            f"{r.get('model')}, {r.get('image_size')} px, {r.get('batch')}",
            seconds(r.get("wall_s")),
            num(r.get("samples_per_s")),
            num(r.get("steady_samples_per_s")),
            num(r.get("pure_compute")),
            times(r.get("of_pure")),
            f"{pct(r.get('data_wait'))} / {pct(r.get('steady_data_wait'))}",
            pct(r.get("val_top1")),
            cores(r),
            num(r.get("workers_used")),
            note(r),
        ]
        for r in part["rows"]
    ]
    return table(header, rows)


def resume_table(part: dict) -> list[str]:
    rows = [
        [f"`{r['run']}`", num(r.get("steps")), num(r.get("resumed_from_step")), seconds(r.get("wall_s")), note(r)]
        for r in part["rows"]
    ]
    lines = table(["run", "ended at step", "resumed from step", "wall", "note"], rows)
    return lines + ([f"\n{part['verdict']}."] if "verdict" in part else [])


def imagenet_table(part: dict) -> list[str]:
    after = part.get("steady_after", 0)
    header = ["model", "decode", "trainer.workers", f"steady samples/s (after step {after})", "pure compute"]
    header += ["of pure", "data-wait (steady)", "cores busy (steady / run)", "training process CPU per 256"]
    header += [
        "host ms per batch: decode (its thread's CPU) / resize / augmentations / hand-over",
        "decode threads busy",
    ]
    header += ["wall", "note"]
    rows = [
        [
            r["model"],
            r["decode"] + (f", first step {seconds(r['first_step_s'])}" if "first_step_s" in r else ""),
            workers(r),
            num(r.get("steady_samples_per_s")),
            num(r.get("pure_compute")),
            times(r.get("of_pure")),
            pct(r.get("steady_data_wait")),
            cores(r),
            f"{num(r.get('own_cpu_ms_per_256'), 1)} ms",
            host_ms(r.get("host_ms")),
            pct(r.get("decode_busy")),
            seconds(r.get("wall_s")),
            note(r),
        ]
        for r in part["rows"]
    ]
    return table(header, rows)


def workers(r: dict) -> str:
    """The workers asked for, and in brackets the number the run came to where that differs (auto)."""
    used = r.get("workers_used")
    return f"{r['workers']}" + (f" ({used})" if used is not None and str(used) != str(r["workers"]) else "")


def host_ms(h: dict | None) -> str:
    if not h:
        return "-"
    decode = num(h["decode"], 2) + (f" ({num(h['decode_cpu'], 2)})" if "decode_cpu" in h else "")
    return " / ".join([decode, *(num(h[k], 2) for k in ("resize", "augment", "hand_over") if k in h)])


def probe_table(part: dict) -> list[str]:
    rows = []
    for r in part.get("rows", []):
        for mode in ("regions", "whole", "progressive"):
            if mode == "progressive" and mode not in r:  # a report from before it was probed
                continue
            m = r.get(mode) or {}
            refused = f"{m.get('refused')} of {m.get('images')}" if "images" in m else "-"
            said = m.get("error") or r.get("error") or ""
            rows.append([r["release"], mode, "yes" if m.get("ok") else "NO", refused, num(m.get("p99_9"), 1)])
            rows[-1] += [num(m.get("max")), num(m.get("mean"), 3), said[:200]]
    lines = [f"{part['verdict']}.\n"] if "verdict" in part else []
    header = ["release", "decode", "works", "refused", "p99.9 vs libjpeg-turbo", "max", "mean", "note"]
    return lines + table(header, rows) + timing_table(part)


def timing_table(part: dict) -> list[str]:
    """The chosen release's settings on one batch of ImageNet-size crops (decoder.settings)."""
    rows = []
    for r in part.get("timing", []):
        refused = f"{r['first_refused']} / {r['refused']}" if "refused" in r else "-"
        per_s = num(1000 * r.get("images", 256) / r["wall_ms"]) if r.get("wall_ms") else "-"
        loaded = {"timing": "torchvision's", "timing-own-nvjpeg": "the kit's"}.get(r.get("mode", "-"), "-")
        rows.append([loaded, r["setting"], refused, num(r.get("host_ms"), 1), num(r.get("cpu_ms"), 1)])
        rows[-1] += [num(r.get("wall_ms"), 1), per_s, num(r.get("p99_9"), 1), num(r.get("max"))]
        rows[-1] += [(r.get("error") or "")[:300]]
    if not rows:
        return []
    header = ["nvJPEG", "setting", "refused (first / left)", "host ms", "process CPU ms", "until done ms", "images/s"]
    header += ["p99.9", "max", "note"]
    intro = (
        "\nOne batch of 256 ImageNet-size photos, RandomResizedCrop's regions, each setting (median of 8; "
        "the decoders at once: each the batch, timed until all are done):\n"
    )
    return [intro] + table(header, rows)


def accuracy_table(part: dict) -> list[str]:
    rows = [[str(r["seed"]), r["decode"], pct(r.get("val_top1")), note(r)] for r in part.get("rows", [])]
    lines = [f"{part['verdict']}.\n"] if "verdict" in part else []
    return lines + table(["seed", "decode", "val top-1", "note"], rows)


def loader_table(part: dict) -> list[str]:
    rows = [
        [
            r["decode"],
            workers(r),
            num(r.get("samples_per_s")),
            num(r.get("batches")),
            seconds(r.get("timed_s")) + ("" if r.get("steady", True) else " (not steady)"),
            seconds(r.get("warmup_s")),
            note(r),
        ]
        for r in part["rows"]
    ]
    header = ["decode", "workers", "samples/s", "batches timed", "timed until steady", "start and drain", "note"]
    return table(header, rows)


def pixel_table(part: dict) -> list[str]:
    rows = [
        [
            r["set"],
            r.get("decoder", "torchvision"),
            num(r.get("images")),
            "yes" if r.get("same_samples") else "NO",
            pct(r.get("exact_share")),
            num(r.get("p99_9")),
            num(r.get("max")),
            num(r.get("mean"), 3),
            note(r),
        ]
        for r in part["rows"]
    ]
    lines = [f"Compared: {part['compared']}; grey levels (0-255) per value.\n"] if "compared" in part else []
    header = ["set", "GPU decoder", "images", "same keys and labels", "equal", "p99.9", "max", "mean", "note"]
    return lines + table(header, rows)


TABLES = {
    "data": data_table,
    "a": default_table,
    "b": resume_table,
    "c": imagenet_table,
    "d": loader_table,
    "e": pixel_table,
    "probe": probe_table,
    "f": accuracy_table,
}


def machine_lines(m: dict) -> list[str]:
    gpu = f"{m['gpu']} ({m['gpu_memory_gb']} GiB), driver {m['driver']}, CUDA {m['cuda']}" if "gpu" in m else "no GPU"
    return [
        f"- GPU: {gpu}",
        f"- CPU: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable by this process), {m['memory_gb']} GiB",
        f"- Python {m['python']}, torch {m['torch']}, torchvision {m['torchvision']}; jpegcrop: {m['jpegcrop']}",
    ]


def settled(results: dict) -> list[str]:
    """One line per finding the numbers give, and the parts that did not run."""
    parts, out = results.get("parts", {}), []
    a = parts.get("a", {}).get("rows", [])
    if a and a[0].get("steady_samples_per_s"):
        r = a[0]
        out.append(
            f"- (a) The default job trains at {num(r['steady_samples_per_s'])} samples/s after step "
            f"{parts['a'].get('steady_after')}, {times(r.get('of_pure'))} its pure compute "
            f"({num(r.get('pure_compute'))}), data-wait {pct(r.get('steady_data_wait'))}; "
            f"val top-1 {pct(r.get('val_top1'))}."
        )
    if "verdict" in parts.get("b", {}):
        out.append(f"- (b) {parts['b']['verdict']}.")
    for model in dict.fromkeys(r["model"] for r in parts.get("c", {}).get("rows", [])):
        rows = [r for r in parts["c"]["rows"] if r["model"] == model and r.get("steady_samples_per_s")]
        if rows:
            each = "; ".join(
                f"{r['decode']} decode x{r['workers']}: {num(r['steady_samples_per_s'])} "
                f"({times(r.get('of_pure'))} pure)"
                for r in rows
            )
            out.append(f"- (c) {model}: {each}.")
    d = [r for r in parts.get("d", {}).get("rows", []) if r.get("samples_per_s")]
    if d:
        out.append(
            "- (d) The loader alone: "
            + "; ".join(f"{r['decode']} x{r['workers']} {num(r['samples_per_s'])}" for r in d)
            + " samples/s."
        )
    for r in parts.get("e", {}).get("rows", []):
        if r.get("status") == "ok":
            out.append(
                f"- (e) {r['set']}, {r.get('decoder', 'torchvision')}: the two decodes differ by at most "
                f"{r['max']} grey levels (p99.9 {r['p99_9']}, "
                f"{pct(r['exact_share'])} of values equal), same samples: {'yes' if r['same_samples'] else 'NO'}."
            )
    for key in ("probe", "f"):
        if "verdict" in parts.get(key, {}):
            out.append(f"- ({key}) {parts[key]['verdict']}.")
    for key, part in parts.items():
        if part.get("status") in ("failed", "skipped"):
            out.append(f"- ({key}) {part['status']}: {part.get('error')}")
    skipped: dict[str, list[str]] = {}  # why: the rows not run for it
    for key, part in parts.items():
        for r in part.get("rows", []):
            if r.get("status") == "skipped":
                name = f"({key}) {' '.join(str(r[k]) for k in ('model', 'decode') if k in r)} x{r.get('workers')}"
                skipped.setdefault(r.get("error") or "?", []).append(name)
    out += [f"- Not run here, {why}: {', '.join(names)}." for why, names in skipped.items()]
    return out or ["- Nothing yet."]


def markdown(results: dict, chart_name: str) -> str:
    m = results.get("machine")
    title = m.get("gpu", "the CPU (rehearsal)") if m else "?"
    lines = [f"# gpu-check: {title} ({results['date']})", "", f"Command: `{results['command']}`", ""]
    if m:
        lines += ["Machine:", "", *machine_lines(m), ""]
    lines += [
        f"Took {results.get('seconds', 0):.0f} s in all.",
        "",
        f"![samples/s per configuration beside pure compute]({chart_name})",
        "",
    ]
    lines += ["## What it settles", "", *settled(results), ""]
    for key, part in results.get("parts", {}).items():
        lines += [f"## ({key}) {part['title']}", ""]
        lines.append(
            f"Status: {part['status']}"
            + (f" ({part['error']})" if part.get("error") else "")
            + f"; {seconds(part.get('seconds'))}."
        )
        lines.append("")
        if part.get("rows"):
            lines += [*TABLES[key](part), ""]
    return "\n".join(lines).rstrip() + "\n"


def bars(results: dict) -> list[tuple[str, float | None, float | None, str]]:
    """(label, measured samples/s, pure compute, note) of each configuration the chart shows."""
    parts, out = results.get("parts", {}), []
    for r in parts.get("a", {}).get("rows", []):
        out.append(("(a) default job", r.get("steady_samples_per_s"), r.get("pure_compute"), note(r)))
    for r in parts.get("c", {}).get("rows", []):
        out.append(
            (
                f"(c) {r['model']} {r['decode']} x{r['workers']}",
                r.get("steady_samples_per_s"),
                r.get("pure_compute"),
                note(r),
            )
        )
    for r in parts.get("d", {}).get("rows", []):
        out.append((f"(d) loader {r['decode']} x{r['workers']}", r.get("samples_per_s"), None, note(r)))
    return out


def chart(results: dict, png: Path, md_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = bars(results)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.42 * max(1, len(shown))))
    values = [v for _, m, p, _ in shown for v in (m, p) if v] or [1.0]
    # From one loader worker to pure compute the rates span orders of magnitude: a log scale.
    ax.set_xscale("log")
    low = min(values) / 4
    ax.set_xlim(low, max(values) * 3)
    labelled: set[str] = set()

    def once(name: str) -> str | None:  # each legend entry once
        first = name not in labelled
        labelled.add(name)
        return name if first else None

    for i, (_, measured, pure, why) in enumerate(shown):
        if pure:
            ax.barh(i + 0.2, pure, height=0.38, color="#c9d1d9", label=once("pure compute"))
        if measured:
            ax.barh(i - 0.2, measured, height=0.38, color="#1f6fb4", label=once("measured"))
            ax.text(measured * 1.05, i - 0.2, f"{measured:,.0f}", va="center", fontsize=8)
        else:
            ax.text(low * 1.1, i - 0.2, (why or "no number")[:70], va="center", fontsize=7, color="#a33")
    ax.set_yticks(range(len(shown)), [label for label, *_ in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s, log scale (training: steady, after the warm-up steps)")
    if labelled:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    m = results.get("machine", {})
    ax.set_title(f"gpu-check {results['date']}: {m.get('gpu', 'CPU rehearsal')}", fontsize=10)
    fig.suptitle(f"drawn from {md_name}", fontsize=8, color="#555555", x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(png, dpi=80, metadata={"Title": Path(md_name).stem, "Source": md_name})
    plt.close(fig)
