"""Shared fixtures: a tiny randomly initialised Qwen2 model with a character tokenizer, built in a temp dir (no
downloads), and a process group of one for code that needs one (FSDP2, reductions); SCRIPTS, the algorithm scripts."""
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scripts do, before torch loads OpenMP
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sanity.scripts import algorithm_scripts  # noqa: E402  (after the path: the tests run from any directory)

SCRIPTS = algorithm_scripts(ROOT)  # the one list of the algorithm scripts that tests run (sanity/scripts.py)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a tool's end-to-end run of a minute or more (the sanity gate, the "
                            "benchmark's vLLM sections, the anatomy): `make test-slow`, not part of `make test`")


# pytest-xdist (`make test`: -n 2 --dist loadfile): a unit of work is a file, so that a file's module-scoped fixtures
# run once, except that the tests that start vLLM engines (in this process or under torchrun) are one unit, run one
# after another on one worker: no two engines at once (test_exit.py's check of /dev/shm would see the other's shared
# memory). (The xdist_group mark of --dist loadgroup cannot do it under pytest 9.2: xdist 3.8 renames node ids by
# an attribute that pytest no longer reads.) A file, or a file::test. The GPU files are there too: on a GPU machine
# their engines share the GPU. Every test skipped without vLLM must be in it (checked at collection, below).
VLLM_TESTS = ("test_vllm.py", "test_exit.py::test_no_gloo_thread_or_shared_memory_left_with_vllm",
              "test_bench.py::test_vllm_generate_on_grpo_batches",
              "test_mismatch_anatomy.py::test_anatomy_on_cpu_with_vllm",
              "test_mismatch_anatomy.py::test_probe_and_exact_capture_run_on_cpu_with_vllm",
              "test_gpu.py", "test_exact_gpu.py")
NEEDS_VLLM = "vLLM is not installed"  # the skip reason of the tests that start an engine


def in_vllm_unit(nodeid: str) -> bool:
    file, _, test = nodeid.partition("::")
    name = os.path.basename(file)
    return name in VLLM_TESTS or f"{name}::{test.split('[')[0]}" in VLLM_TESTS


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling
    if not hasattr(LoadFileScheduling, "_split_scope"):  # (a private method: a later xdist may rename it)
        raise pytest.UsageError("this pytest-xdist's file scheduler has no _split_scope: the vLLM tests cannot be "
                                "kept to one worker; run with TEST_WORKERS=0 or pytest-xdist 3.8")

    class FilesAndVLLM(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return "vllm" if in_vllm_unit(nodeid) else nodeid.partition("::")[0]
    return FilesAndVLLM(config, log)


def pytest_collection_modifyitems(config, items):
    """A test that needs vLLM (skipped without it) but is not in VLLM_TESTS would run beside another engine: refused."""
    missing = [item.nodeid for item in items if not in_vllm_unit(item.nodeid) and any(
        m.kwargs.get("reason") == NEEDS_VLLM for m in item.iter_markers("skipif"))]
    if missing:
        raise pytest.UsageError(f"tests skipped without vLLM but not in tests/conftest.py's VLLM_TESTS (so that no "
                                f"two engines run at once under pytest-xdist): {', '.join(missing)}")


CHARS = list("0123456789+=abcdefghijklmnopqrstuvwxyz ")


def make_char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_tiny_model_dir(path: str, seed: int = 0, tie: bool = True, head_dim: int = 32, **config) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = make_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=128,
                      tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=None, **config)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger random weights than the init, so that distributions are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def process_group():
    from common.dist import setup_distributed
    _session_group.append(True)
    return setup_distributed()


_session_group = []  # not empty once the session made its process group


def _group_back() -> None:
    """A vLLM engine's shutdown takes the default process group down with it: the tests after it get the group back
    as the session made it (setup_distributed does nothing while one exists)."""
    if _session_group and not torch.distributed.is_initialized():
        from common.dist import setup_distributed
        setup_distributed()


@pytest.fixture(scope="module", autouse=True)
def _process_group_for_the_module():  # (a module's fixtures may need it: autouse ones come first in their scope)
    _group_back()


@pytest.fixture(autouse=True)
def _process_group_for_the_test():
    _group_back()


def fp32_rounding_bound(cfg, seq_len: int, n_tokens: int, backward: bool) -> float:
    """Relative size (to the magnitude of the terms summed) of the largest difference that rounding alone can make
    between two fp32 computations of the same log-probs (backward=False) or gradients (backward=True) that sum their
    terms in other orders, as the compiled kernels do: u * (the lengths of the sums along the longest path through
    the model), u = eps/2 the unit roundoff. A sum of n terms in any order is off by at most n * u * sum|terms|
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Sec. 4.2), and errors add along a path. Forward
    per layer: the norm (hidden), q/k/v (hidden), q.k (head_dim), the softmax and the weighted sum of values
    (seq_len each), o_proj (heads * head_dim), the norm, gate/up (hidden), down (intermediate); then the final norm,
    the head (hidden) and the log-softmax (vocab). The backward sums the transposed lengths along the same path, and
    each weight's gradient sums over the n_tokens positions of every micro-batch. A worst case: the differences
    measured on a CPU are about 1/100 of it; 16-bit or TF32 arithmetic (u >= 2^-11) or a wrong mask would exceed it."""
    h, heads, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    layer = h + h + hd + seq_len + seq_len + heads * hd + h + h + cfg.intermediate_size
    n = cfg.num_hidden_layers * layer + h + h + cfg.vocab_size
    if backward:
        n = 2 * n + n_tokens
    return n * torch.finfo(torch.float32).eps / 2


def assert_close_to_rounding(got, want, bound):
    """|got - want| <= bound * max|want|, elementwise: the largest element of a tensor stands for the magnitude of
    the terms summed into each one, since an element near zero is a sum of terms that cancel and its rounding error
    is relative to them, not to itself (a relative tolerance failed on such an element: 2.2e-6 off on 1.7e-4)."""
    tol = bound * want.abs().max().item()
    worst = (got - want).abs().max().item()
    assert worst <= tol, f"max |difference| {worst:.3g} > {tol:.3g} (rounding bound {bound:.3g} x max |value|)"
