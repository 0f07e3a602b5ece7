"""CLI: train against a deployed rollout app.

    python -m serve_app.trainer --config trainer/flowgrpo --steps 30 --out outputs/run1 [key=value ...]
    python -m serve_app.trainer --out outputs/run1 --resume outputs/run1/checkpoint --steps 60
    python -m serve_app.trainer --workers 2 --out outputs/dp [trainer.distributed.strategy=fsdp ...]
    python -m serve_app.trainer --url http://127.0.0.1:8000 --out outputs/run1     # over HTTP, no Ray

With --url the trainer reaches the app through its HTTP API alone (rollouts with their trajectories, versions
published with POST /v1/weights); the bearer token comes from FLOWGRPO_API_TOKEN or --token-file.
With --workers N > 1 (trainer.distributed.workers) the run is N Ray Train workers on the cluster
(serve_app.trainer.distributed): each replays its shard of every rollout, rank 0 publishes and writes.

The config is validated before anything connects to Ray, so a typo fails in a second.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m serve_app.trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="trainer/flowgrpo", help="config name under configs/ or a .yaml path")
    parser.add_argument("--steps", type=int, default=None, help="overrides trainer.steps")
    parser.add_argument("--out", required=True, help="output directory, e.g. outputs/run1")
    parser.add_argument("--resume", default=None, help="a checkpoint directory (outputs/<run>/checkpoint)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: the running local one)")
    parser.add_argument("--url", default=None, help="train over the app's HTTP API at this URL (no Ray)")
    parser.add_argument("--token-file", default=None,
                        help="with --url: a file holding the API's bearer token (default: $FLOWGRPO_API_TOKEN)")
    parser.add_argument("--workers", type=int, default=None,
                        help="overrides trainer.distributed.workers: N > 1 trains on N Ray Train workers")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.lr=1e-3")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from serve_app.config import ConfigError
    from serve_app.trainer.config import load_trainer_config

    overrides = list(args.overrides) + ([f"trainer.steps={args.steps}"] if args.steps is not None else [])
    overrides += [f"trainer.distributed.workers={args.workers}"] if args.workers is not None else []
    try:
        config = load_trainer_config(args.config, overrides)
    except ConfigError as e:
        print(f"invalid trainer config: {e}", file=sys.stderr)
        return 2

    from serve_app.trainer.loop import FlowGRPOTrainer

    if args.url is not None:
        return train_over_http(config, args, FlowGRPOTrainer)

    import ray

    from serve_app.trainer.connect import PlacementError, connect_to_app

    ray.init(address=args.address, log_to_driver=False)
    if config.trainer.distributed.workers > 1:
        from serve_app.trainer.distributed import run_data_parallel

        try:
            report = run_data_parallel(config, args.out, resume=args.resume)
        except PlacementError as exc:
            print(f"cannot start the training workers: {exc}", file=sys.stderr)
            return 2
        print(report.get("summary", report))
        return 0
    app = connect_to_app(config)
    trainer = FlowGRPOTrainer(config, app.client, args.out, resume=args.resume, replica_handle=app.replica)
    trainer.train()
    print(trainer.summary())
    return 0


def train_over_http(config, args: argparse.Namespace, trainer_cls) -> int:
    """The same loop with the HTTP client and publisher; this process never imports Ray."""
    import os
    from pathlib import Path

    from serve_app.trainer.connect import connect_over_http

    if config.trainer.distributed.workers > 1:
        print("--url trains in one process; data-parallel workers (--workers) run on the app's Ray cluster",
              file=sys.stderr)
        return 2
    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("FLOWGRPO_API_TOKEN")
    try:
        app = connect_over_http(args.url, token or None)
    except (ConnectionError, OSError) as exc:
        print(f"cannot reach the app at {args.url}: {exc}", file=sys.stderr)
        return 2
    trainer = trainer_cls(config, app.client, args.out, resume=args.resume, publisher=app.publisher)
    trainer.train()
    print(trainer.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
