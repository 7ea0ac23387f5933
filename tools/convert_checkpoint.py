"""Convert between Hugging Face MiniMax checkpoints and megacispo (Megatron distributed) checkpoints.

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir HF --out CKPT [--tp T --pp P --ep E --etp X]
    python tools/convert_checkpoint.py megatron-to-hf --ckpt CKPT --out HF

The command line of megacispo.convert, which streams tensor by tensor with bounded memory; see
docs/conversion.md for the flags.
"""

import sys

from megacispo.convert import main

if __name__ == "__main__":
    sys.exit(main())
