"""Evaluation entry point:

    torchrun --nproc-per-node N -m megacispo.eval --config X.yaml --load CKPT [--set k=v ...]

Evaluates data.test_prompts as the eval section asks (megacispo.evaluation.evaluator: greedy accuracy, pass@k
and mean@k over eval.num_samples responses per prompt, scored by rl.reward) under the config's
parallel layout. --load is a megacispo checkpoint (a step_* directory, or a checkpoints root: its
newest) or a Hugging Face directory. The logging rank prints a table of the metrics and writes them to
TensorBoard under <train.run_dir>/eval/tensorboard, at the checkpoint's step (0 for a Hugging Face
directory).
"""

from __future__ import annotations

import sys

from megacispo.evaluation.source import check_eval, eval_plan, weights_source
from megacispo.startup import bad_input_exits, build_parser, load_rl_prompt_file, load_tokenizer, plan, start_up


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__, load_field="train.load")
    args = parser.parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args, check_eval)
        source = weights_source(config)
        if args.dry_run:
            print(plan(config, world_size))
            print(eval_plan(config, source))
            return 0
        tokenizer = load_tokenizer(config)
        records, _ = load_rl_prompt_file(config, tokenizer, "test_prompts")
    # After the dry run, which imports no Megatron-Core: the run does.
    from megacispo.evaluation.run import run_eval

    run_eval(config, source, tokenizer, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
