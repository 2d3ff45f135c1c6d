"""Merge a LoRA checkpoint's adapter into its base model: an HF directory (CHECKPOINT/merged) that init_from,
launch.eval and vLLM load. Loading a LoRA checkpoint as a model merges it the same way on first use.

    python -m launch.merge runs/demo/lora/checkpoints/step_3 [--base MODEL]"""
from __future__ import annotations

import argparse
import sys

from models.checkpoint import merge_lora_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a LoRA checkpoint directory (checkpoints/step_<n>)")
    parser.add_argument("--base", default=None, help="the base model (default: the one adapter_config.json names)")
    args = parser.parse_args(argv)
    try:
        print(merge_lora_checkpoint(args.checkpoint, args.base))
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {args.checkpoint}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
