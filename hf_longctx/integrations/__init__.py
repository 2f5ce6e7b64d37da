"""Bindings to transformers, PEFT and accelerate."""
