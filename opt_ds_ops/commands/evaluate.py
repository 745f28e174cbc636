"""``ds-ops evaluate DIR``: train, score and compare with two baselines on labelled data (one table)."""

from __future__ import annotations

import json
import resource
import sys
import time

from ..config.conffile import DEFAULT_CONFIG_PATH
from ..dataset import dataset_stem
from ..health.device import plan_device
from ..model.detection import fmt_metric
from ..scoring.evaluate import MachineFiles, format_table, mean_row, plot, run_evaluation, smd_machines
from ..training.stopping import step_cap
from . import CliError, load_cfg


def add_parser(sub) -> None:
    e = sub.add_parser("evaluate", help="train and score labelled data; compare with a z-score and the seed's score")
    e.add_argument("smd_dir", metavar="DIR", nargs="?",
                   help="SMD-layout folder: train/ test/ test_label/ [interpretation_label/]")
    e.add_argument("--train", help="training file (instead of DIR; with --test and --labels)")
    e.add_argument("--test", help="test file")
    e.add_argument("--labels", help="one 0/1 per test row")
    e.add_argument("--interpretation", help="SMD interpretation_label file (for HitRate), with --train")
    e.add_argument("--machines", nargs="+", metavar="NAME", help="only these machines of DIR (e.g. machine-1-2)")
    e.add_argument("--models-dir", help="keep the trained models here (default: a temporary folder, removed)")
    e.add_argument("--config", help=f"configuration file (default: {DEFAULT_CONFIG_PATH} if present)")
    e.add_argument("--epochs", type=int)
    e.add_argument("--seed", type=int)
    e.add_argument("--device", help="auto, cpu, mps, cuda or cuda:N (default: the configuration's)")
    e.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    e.add_argument("--plot", metavar="FILE.png", help="write score, threshold and labelled segments per machine")
    e.add_argument("--plot-machine", metavar="NAME", help="with --plot: only this machine")
    e.set_defaults(func=run)


def _machines(args) -> list[MachineFiles]:
    explicit = [args.train, args.test, args.labels]
    if args.smd_dir and any(explicit):
        raise CliError("give either DIR or --train/--test/--labels, not both")
    if args.smd_dir:
        return smd_machines(args.smd_dir, args.machines)
    if not all(explicit):
        raise CliError("give DIR (SMD layout) or all of --train, --test and --labels")
    if args.machines:
        raise CliError("--machines needs DIR")
    return [MachineFiles(dataset_stem(args.train), args.train, args.test, args.labels, args.interpretation)]


def run(args) -> int:
    """``ds-ops evaluate``: one table (or --json) of ds-ops's score and both baselines per machine."""
    cfg = load_cfg(args, {"device": args.device, "train.epochs": args.epochs, "train.seed": args.seed})
    machines = _machines(args)
    plan = plan_device(cfg.device, cfg.amp)
    t0 = time.perf_counter()
    if not args.json:
        t = cfg.train
        length = (f"plateau rule (at most {step_cap(t):,} steps or {t.epochs} epochs, batch {t.batch_size}, lr {t.lr:g})"
                  if step_cap(t) else f"{t.epochs} epochs")
        print(f"evaluating {len(machines)} machine(s) on {plan.device} amp={plan.amp_name}: {length}, "
              f"input window {t.input_window} ({t.window_error}), score {t.score_smoothing} over {t.score_window} rows, "
              f"input clip {t.input_clip:g}, "
              f"error floor {t.error_floor:g}, threshold {t.threshold_method}", flush=True)
    bar = None
    if not args.json and sys.stderr.isatty():  # a progress bar on a terminal only, never in a pipe
        from tqdm import tqdm

        bar = tqdm(total=len(machines), unit="machine", desc="evaluating", file=sys.stderr)

    def on_machine(r) -> None:
        if bar is not None:
            bar.update(1)
            bar.write(f"  {r['machine']} done")
        elif not args.json:
            print(f"  {r['machine']} done", flush=True)

    try:
        results = run_evaluation(machines, cfg, plan, models_dir=args.models_dir, keep_scores=bool(args.plot),
                                 on_machine=on_machine)
    finally:
        if bar is not None:
            bar.close()
    means = mean_row(results)
    if args.plot:
        plot(results, args.plot, args.plot_machine)
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    seconds = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # evaluate's cost (KiB on Linux)
    if args.json:
        print(json.dumps({"machines": public, "mean": means, "seconds": seconds, "peak_rss_bytes": peak_rss,
                          "config": {"train": cfg.train.__dict__}}, sort_keys=True))
        return 0
    for line in format_table(public, means):
        print(line)
    ours, z = means["ds-ops"], means["z-ema"]
    wins = sum(r["ds-ops"]["roc_auc"] is not None and r["z-ema"]["roc_auc"] is not None
               and r["ds-ops"]["roc_auc"] > r["z-ema"]["roc_auc"] for r in public)
    print(f"ds-ops vs z-ema: mean ROC-AUC {fmt_metric(ours['roc_auc'])} vs {fmt_metric(z['roc_auc'])}, mean PR-AUC "
          f"{fmt_metric(ours['pr_auc'])} vs {fmt_metric(z['pr_auc'])}; higher ROC-AUC on {wins} of {len(public)} machines")
    pca = means["pca-ema"]  # the linear reference
    print(f"ds-ops vs pca-ema: mean ROC-AUC {fmt_metric(ours['roc_auc'])} vs {fmt_metric(pca['roc_auc'])}, mean PR-AUC "
          f"{fmt_metric(ours['pr_auc'])} vs {fmt_metric(pca['pr_auc'])}")
    if ours["hit_rate_150"] is not None:
        print(f"which metrics (HR: HitRate per labelled segment, of the ranking ds-ops score prints): "
              f"HitRate@100% {ours['hit_rate_100']:.4f}, HitRate@150% {ours['hit_rate_150']:.4f}; per labelled row "
              f"(OmniAnomaly's per-point definition; it reports about 0.89 at 150 % on SMD): "
              f"{ours['row_hit_rate_100']:.4f} and {ours['row_hit_rate_150']:.4f}; z-ema per segment "
              f"{z['hit_rate_100']:.4f} and {z['hit_rate_150']:.4f}")
    if args.plot:
        print(f"plot: {args.plot}")
    print(f"{len(public)} machine(s) in {seconds:.1f} s, peak RSS {peak_rss / 1024**2:,.0f} MiB; alarms/d: false "
          f"alarms per day of normal rows ({cfg.train.sample_period_s:g} s per row: train.sample_period_s); seg-hit: the share of labelled "
          f"segments with a flagged row, at the threshold")
    return 0
