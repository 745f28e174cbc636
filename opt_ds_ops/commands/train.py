"""``ds-ops train DATASET``: train the autoencoder on one dataset and save it in the model store."""

from __future__ import annotations

import argparse
import json
import os
import sys

import dataclasses

from ..config.conffile import DEFAULT_CONFIG_PATH
from ..health.policy import gate_job, summary_line
from ..training.fit import EpochStats
from ..training.job import JobError, columns_note, find_sidecar, read_sidecar, run_job
from ..training.stopping import step_cap, throttled
from . import load_cfg


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train the autoencoder on a dataset and save it in the model store")
    t.add_argument("dataset", metavar="DATASET",
                   help="telemetry file: .csv/.txt/.tsv[.gz], .parquet, .feather/.arrow, .npy, .npz, .pt")
    t.add_argument("--name", help="model name (default: the sidecar's name, else the dataset file's stem)")
    t.add_argument("--sidecar", metavar="FILE",
                   help="dataset options (YAML: name, time_column, columns, exclude_columns, time_order, "
                        "metric_names, exclude_flagged, incidents); "
                        "default: STEM.yaml beside the dataset, if there is one")
    t.add_argument("--time-column", help="auto, none, a column name or a 1-based number (dataset.time_column)")
    t.add_argument("--columns", type=_names, metavar="A,B,...", help="the feature columns (dataset.columns)")
    t.add_argument("--exclude-columns", type=_names, metavar="A,B,...", help="columns left out (dataset.exclude_columns)")
    t.add_argument("--models-dir", help="model store directory (default: models_dir from the config)")
    t.add_argument("--config", help=f"configuration file (default: {DEFAULT_CONFIG_PATH} if present)")
    t.add_argument("--epochs", type=int)
    t.add_argument("--batch-size", type=int)
    t.add_argument("--seed", type=int)
    t.add_argument("--device", help="auto, cpu, mps, cuda or cuda:N")
    t.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"])
    t.add_argument("--nproc", type=_nproc, default=1, metavar="N",
                   help="train with N processes under torchrun (DistributedDataParallel; gloo on the CPU, "
                        "nccl with one GPU each); default 1")
    t.add_argument("--json", action="store_true", help="print one JSON summary instead of text")
    t.set_defaults(func=run)


def _nproc(text: str) -> int:
    """``--nproc N``: an integer >= 1 (argparse says so otherwise, exit code 2)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def _names(text: str) -> tuple[str, ...]:
    """``--columns a,b,3`` -> ("a", "b", "3") (names may not contain commas here; a sidecar takes any name)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def dataset_options(args, cfg) -> tuple:
    """Return (dataset options, model name or None, sidecar path or None) for ``ds-ops train``:
    the conffile's ``dataset:``, then the sidecar, then the command line's options."""
    options, name = cfg.dataset, None
    sidecar = args.sidecar or find_sidecar(args.dataset)
    if sidecar:
        try:
            options, name = read_sidecar(sidecar, cfg.dataset)
        except JobError as e:
            if args.sidecar:
                raise
            same = args.config and os.path.realpath(args.config) == os.path.realpath(sidecar)
            raise JobError("dataset", f"{e} ({'your --config file ' if same else ''}{sidecar} was read as the sidecar "
                           f"of {os.path.basename(args.dataset)} because it sits beside it under the dataset's name; "
                           "rename it, or give the sidecar with --sidecar FILE)", e) from None
    flags = {"time_column": args.time_column, "columns": args.columns, "exclude_columns": args.exclude_columns}
    options = dataclasses.replace(options, **{k: v for k, v in flags.items() if v is not None})
    return options, args.name or name, sidecar


def _is_asked(device, spec: str) -> bool:
    """True if torch.device ``device`` is what ``--device spec`` asked for (cuda matches any cuda:N)."""
    return str(device) == spec or device.type == spec


def _threshold_how(r) -> str:
    """How the threshold was set, for the summary line: ``q=0.99``, ``alarm_rate`` or ``spot``."""
    return f"q={r.threshold_quantile}" if r.threshold_method == "quantile" else r.threshold_method


def run(args) -> int:
    """``ds-ops train DATASET``: train, save, print per-epoch losses and the model directory."""
    cfg = load_cfg(
        args,
        {"models_dir": args.models_dir, "device": args.device, "amp": args.amp, "train.epochs": args.epochs,
         "train.batch_size": args.batch_size, "train.seed": args.seed},
    )
    options, name, sidecar = dataset_options(args, cfg)
    gate = gate_job(cfg)
    if gate.action != "run":
        raise JobError("health", f"health gate: {gate.action}: {gate.reason}")
    if args.device not in (None, "auto") and not _is_asked(gate.plan.device, args.device):
        raise JobError("health", f"--device {args.device}: no CUDA GPU is usable here, the health gate "
                                 f"offers {gate.plan.device} ({gate.reason})")
    bar = None
    # under the plateau rule the bound that ends training first is max_steps: count steps, not epochs
    max_steps = step_cap(cfg.train)
    if not args.json and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=max_steps or cfg.train.epochs, unit="step" if max_steps else "epoch", desc="training",
                   file=sys.stderr)

    def on_epoch(s: EpochStats) -> None:
        if args.json:
            return
        if bar is not None:
            bar.set_postfix(loss=f"{s.train_loss:.4f}", val=f"{s.val_loss or 0:.4f}")
            bar.update(min(s.steps, max_steps) - bar.n if max_steps else 1)
            bar.write(s.line(cfg.train.epochs, max_steps), file=sys.stderr)
        else:
            print(s.line(cfg.train.epochs, max_steps), flush=True)

    if not args.json:
        health = "" if gate.report["verdict"] == "ok" else f"; {summary_line(gate)}"
        procs = f", {args.nproc} processes" if args.nproc > 1 else ""
        length = (f"until the validation loss plateaus, at most {max_steps:,} steps or {cfg.train.epochs} epochs"
                  if max_steps
                  else f"{cfg.train.epochs} epochs")
        reads = (f"; reads each metric's change beside its level (its term the "
                 f"{'larger' if cfg.train.difference_term == 'max' else 'mean'} of the two)"
                 if cfg.train.input_differences and args.nproc == 1 else "")
        print(f"training on {args.dataset} ({gate.plan.device} amp={gate.plan.amp_name}, {length}{procs}"
              f"{health}){reads}{f'; options from {sidecar}' if sidecar else ''}", flush=True)
    if options.incidents:  # only a daemon job passes the promotion gate
        print("ds-ops: note: the sidecar's incidents label rows for the daemon's promotion gate; ds-ops train "
              "publishes the new version as current without a gate", file=sys.stderr)
    try:
        job = run_job(args.dataset, cfg, name=name, plan=gate.plan, health=gate.report,
                      on_epoch=throttled(on_epoch, cfg.train),  # one line a second past epoch 10
                      options=options, explicit_name=name is not None, nproc=args.nproc)
        if bar is not None:  # done: a plateau or the epochs cap ends it before max_steps, the bar's bound
            bar.update(bar.total - bar.n)
    finally:
        if bar is not None:
            bar.close()
    r, md = job.result, job.metadata
    summary = {
        "model_dir": job.model_dir,
        "name": md["name"],
        "version": md["version"],
        "rows": job.dataset.rows,
        "features": job.dataset.features,
        "device": md["device"],
        "amp_dtype": md["amp_dtype"],
        "epochs": md["epochs"],
        "final_train_loss": md["final_train_loss"],
        "final_val_loss": md["final_val_loss"],
        "samples_per_s": r.samples_per_s,
        "threshold": r.threshold,
        "skipped_steps": r.skipped_steps,
        "duration_s": r.duration_s,
        "health": md["health"]["verdict"],
        "time": md["dataset"]["time"],
        "left_out": md["dataset"]["left_out"],
        "notes": md["dataset"]["notes"],
        "data_placement": md.get("data_placement"),
        "step_mode": md.get("step_mode"),
        "peak_rss_bytes": md.get("peak_rss_bytes"),
        "stopping": md.get("stopping"),
        "warnings": md.get("warnings"),
    }
    if job.report_warning:  # the picture failed, the model is saved
        print(f"ds-ops: warning: {job.report_warning}", file=sys.stderr)
    for warning in md.get("warnings") or []:  # a suspect model
        print(f"ds-ops: warning: suspect model: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(
            f"trained {md['name']} on {job.dataset.rows} rows x {job.dataset.features} features, "
            f"device {md['device']} amp {md['amp_dtype']}, {r.samples_per_s:,.0f} samples/s, "
            f"threshold {r.threshold:.4f} ({_threshold_how(r)}); {r.stopping_line}"
        )
        if md.get("data_placement") == "streamed":
            print(f"note: {r.placement_note}; peak RSS {md['peak_rss_bytes'] / 2**20:,.0f} MiB")
        note = columns_note(md["dataset"])
        if note:
            print("columns: " + note[2:].replace("; ", "\n  "))
        print(f"model: {job.model_dir}")
    return 0


