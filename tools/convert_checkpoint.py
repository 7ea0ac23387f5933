"""Convert between Hugging Face MiniMax checkpoints and megacispo (Megatron distributed) checkpoints,
streaming tensor by tensor (memory: a few tensors, never the model).

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir HF --out CKPT [--tp T --pp P --ep E --etp X]
    python tools/convert_checkpoint.py megatron-to-hf --ckpt CKPT --out HF [--base BASE]
    python tools/convert_checkpoint.py megatron-to-peft --ckpt CKPT --out ADAPTER [--base BASE]

A LoRA run's checkpoint holds its adapters alone: megatron-to-hf writes it merged into its base (the
run's train.load, which the checkpoint records, or --base), megatron-to-peft writes the adapters alone
as a PEFT LoRA adapter directory for transformers' PeftModel over the Hugging Face base.

A checkpoint written here loads at any layout; --tp/--pp/--ep/--etp are validated and recorded in
meta.json. Everything is written beside --out and renamed at the end: a failed conversion leaves
nothing at --out. An HF directory is checked as train.load checks one (config.json, then the
tensors' headers) before anything is read, and each tensor is checked to be finite as it is read;
bad input ends with exit code 2 and one error: line. See docs/guides/conversion.md.
"""

import argparse
import sys
import warnings

from megacispo.checkpoint.to_hf import DEFAULT_MAX_SHARD_BYTES, megatron_to_hf, megatron_to_peft
from megacispo.checkpoint.to_megatron import hf_to_megatron
from megacispo.models.config import PARAMS_DTYPES
from megacispo.startup import bad_input_exits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("hf-to-megatron", help="HF directory -> megacispo checkpoint")
    to_megatron.add_argument("--hf-dir", required=True, help="Hugging Face model directory")
    to_megatron.add_argument("--out", required=True, help="new checkpoints root; step_00000000 is written in it")
    to_megatron.add_argument("--tp", type=int, default=1, help="tensor-parallel size to validate and record")
    to_megatron.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to validate and record")
    to_megatron.add_argument("--ep", type=int, default=1, help="expert-parallel size to validate and record")
    to_megatron.add_argument("--etp", type=int, default=None,
                             help="expert tensor-parallel size to validate and record (default: --tp)")
    to_megatron.add_argument("--rotary-dim", type=int, default=None,
                             help="rotated channels per head (default: config.json's rotary_dim, else head_dim "
                                  "as HF transformers computes; the original MiniMax uses head_dim / 2)")
    to_megatron.add_argument("--dtype", choices=["auto", *PARAMS_DTYPES], default="auto",
                             help="parameter dtype of the checkpoint (auto: the HF tensors' dtype)")
    to_hf = commands.add_parser("megatron-to-hf", help="megacispo checkpoint -> HF directory")
    to_peft = commands.add_parser("megatron-to-peft", help="a LoRA run's checkpoint -> PEFT LoRA adapter directory")
    for command in (to_hf, to_peft):
        command.add_argument("--ckpt", required=True, help="step_* directory, or a checkpoints root (its newest step)")
    to_hf.add_argument("--out", required=True, help="new HF model directory")
    to_hf.add_argument("--base", default=None,
                       help="a LoRA run's checkpoint: the base its adapters merge into, a megacispo checkpoint or "
                            "an HF directory (default: the run's train.load, as the checkpoint records it)")
    to_hf.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                       help="largest safetensors shard (default 5 GiB)")
    to_peft.add_argument("--out", required=True, help="new adapter directory")
    to_peft.add_argument("--base", default=None,
                         help="adapter_config.json's base_model_name_or_path, the HF directory PEFT loads the "
                              "adapters over (default: the run's train.load, as the checkpoint records it)")
    for command in (to_megatron, to_hf):
        command.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    with bad_input_exits():
        if args.command == "hf-to-megatron":
            path = hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                                  rotary_dim=args.rotary_dim, dtype=args.dtype, progress=not args.no_progress)
        elif args.command == "megatron-to-hf":
            path = megatron_to_hf(args.ckpt, args.out, base=args.base, max_shard_bytes=args.max_shard_bytes,
                                  progress=not args.no_progress)
        else:
            path = megatron_to_peft(args.ckpt, args.out, base=args.base)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
