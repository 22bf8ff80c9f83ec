"""Run an algorithm script with every response sampled to its --max-response-len (vLLM's ignore_eos): the worst case
of a step's time and memory, which answers that end early never show. A benchmark's concern, not a training flag:
bench/benchmark.py --rl-force-len runs grpo.py through it.

    python bench/forced_length.py grpo.py --model DIR --sampler vllm --max-response-len 8192 ...
    torchrun --nproc_per_node 2 bench/forced_length.py grpo.py ...

vLLM only: with the fallback sampler (--sampler hf, or no vLLM installed) it stops with an error before training.
"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def force_full_length() -> None:
    """Every VLLMSampler of this process samples to max_new_tokens, and the fallback sampler is refused."""
    from common import sampler
    from common.vllm_sampler import VLLMSampler
    VLLMSampler.ignore_eos = True
    make = sampler.make_sampler

    def vllm_only(*args, **kwargs):
        made = make(*args, **kwargs)
        if not isinstance(made, VLLMSampler):
            raise SystemExit(f"{os.path.basename(__file__)}: responses can be forced to their full length with the "
                             f"vLLM sampler only, not {type(made).__name__} (--sampler vllm, with vLLM installed)")
        return made
    sampler.make_sampler = vllm_only


def main(argv: list[str]) -> None:
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit(f"usage: python {os.path.relpath(__file__, ROOT)} SCRIPT.py [its arguments]")
    script = argv[0] if os.path.isabs(argv[0]) else os.path.join(ROOT, argv[0])
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    force_full_length()
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
