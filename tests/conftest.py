"""Shared fixtures: a tiny randomly initialised Qwen2 model with a character tokenizer, built in a temp dir (no
downloads), and a process group of one for code that needs one (FSDP2, reductions)."""
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scripts do, before torch loads OpenMP
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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
    return setup_distributed()
