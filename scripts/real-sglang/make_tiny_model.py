"""Tiny random Llama-architecture chat model + byte-level BPE tokenizer, made offline."""
import argparse
import glob
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--vocab", type=int, default=2048)
ap.add_argument("--eos-scale", type=float, default=12.0)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
torch.manual_seed(a.seed)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# training text: this Python's own standard-library sources (always present, no download)
files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:120]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
tok.train(files, trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=SPECIAL,
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False))
# ChatML like Qwen; enable_thinking=false inserts an empty think block like Qwen3's template
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n'"
    " + (message['content'] if message['content'] is string else '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", unk_token=None)
hf_tok.chat_template = CHAT_TEMPLATE
hf_tok.model_max_length = 8192
hf_tok.save_pretrained(a.out)
eos_id = hf_tok.convert_tokens_to_ids("<|im_end|>")
pad_id = hf_tok.convert_tokens_to_ids("<|endoftext|>")
cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=pad_id, eos_token_id=eos_id,
                  pad_token_id=pad_id, torch_dtype="float32")
model = LlamaForCausalLM(cfg)
with torch.no_grad():  # make <|im_end|> likely enough that some completions end with "stop"
    model.lm_head.weight[eos_id] *= a.eos_scale
model.save_pretrained(a.out, safe_serialization=True)
with open(os.path.join(a.out, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": pad_id}, f)
print(json.dumps({"out": a.out, "vocab": len(hf_tok), "eos_id": eos_id,
                  "params": sum(p.numel() for p in model.parameters())}))
