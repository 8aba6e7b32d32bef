"""Exporting merges as adapters: a merge of LoRA experts written as one PEFT LoRA adapter."""
