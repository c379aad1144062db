"""A Hugging Face causal LM as a trainapp task, exported in Hugging Face's own format (see task.py)."""

from hf_causal_lm_task.task import CausalLM

__all__ = ["CausalLM"]
