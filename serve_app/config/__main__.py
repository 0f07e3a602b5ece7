"""Print a config as the service resolves it: every setting, the defaults of the schema included.

    python -m serve_app.config diffusion_rollout [model=tiny_sd3 sampling.num_steps=4 ...]
    python -m serve_app.config trainer/shapes        (configs under trainer/ use the trainer's schema)
"""

from __future__ import annotations

import argparse
import sys

from serve_app.config import ConfigError, RolloutConfig, config_to_yaml, load_config
from serve_app.imports import import_object

# Named by import path: the config package knows nothing of the trainer that extends its schema.
TRAINER_SCHEMA = "serve_app.trainer.config:TrainerRunConfig"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="config name under configs/ (or a .yaml path)")
    parser.add_argument("overrides", nargs="*", help="overrides, e.g. sampling.num_steps=4 model=tiny_sd3")
    parser.add_argument("--schema", default=None,
                        help=f"'package.module:Class' of the schema; default RolloutConfig ({TRAINER_SCHEMA} for trainer/*)")
    args = parser.parse_args(argv)
    schema_path = args.schema or (TRAINER_SCHEMA if args.name.startswith("trainer/") else None)
    schema = RolloutConfig if schema_path is None else import_object(schema_path, what="config schema")
    try:
        config = load_config(args.name, args.overrides, schema=schema)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    print(config_to_yaml(config), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
