"""Make a tiny random Llama with a real tokenizer, for serving tests with the CPU build of vLLM.

    VENV/bin/python tests/vllm/make_tiny_model.py OUT_DIR [MAX_POSITIONS]

MAX_POSITIONS (default 16384) is its context, the cpu-tiny profile's
--max-model-len: the stall test needs generations long enough to still run when
it freezes the engine, and every test and benchmark serves the same model with
the same context so that vLLM's compiled graph, cached per user, is compiled once.

Run with vLLM's interpreter (it has torch, transformers and tokenizers). hidden
256 with 4 heads gives head_dim 64: the CPU attention backend rejects 16.
"""

import sys
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TEXT = ["the gpu runs at the locked clock", "vllm serves the tiny model", "hello world, this is a test"] * 50


def main(out: Path, positions: int = 16384) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(out)
    config = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=positions,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 16384)
