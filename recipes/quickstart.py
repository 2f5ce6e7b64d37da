"""The quickstart (docs/getting-started.md): a plain `transformers.Trainer` script plus hf_longctx's five additions
(marked `# hf_longctx`). Run: torchrun --nproc-per-node N recipes/quickstart.py MODEL 'FILES' OUT_DIR STEPS
(MODEL: a causal LM path or hub id with its tokenizer; FILES: text files, one document each;
`python recipes/tiny.py runs/tiny` makes both locally; on CPU it uses gloo)."""
import os
import sys

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from hf_longctx import LongContextTrainer, exit_rank, init_sequence_parallel, patch, tokenize_dataset

model_id, data_files, output_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
args = TrainingArguments(output_dir=output_dir, max_steps=steps, learning_rate=2e-5, logging_steps=1, report_to=[],
                         bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())  # sets up the process group
mesh = init_sequence_parallel(ulysses_degree=int(os.environ.get("WORLD_SIZE", 1)))  # hf_longctx: all ranks one SP group
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32)
patch(model, mesh)  # hf_longctx: attention through Ulysses/ring
raw = load_dataset("text", data_files=data_files, sample_by="document", split="train")
data = tokenize_dataset(raw, tokenizer)  # hf_longctx: one row per document, nothing truncated
trainer = LongContextTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                             mesh=mesh, max_tokens=16384, tokens_per_step=32768)  # hf_longctx: the new kwargs
trainer.train()
trainer.save_model()  # a consolidated save_pretrained directory; loads without hf_longctx
exit_rank()  # hf_longctx: leave without interpreter teardown (a gloo worker can abort it)
