"""Evaluation tasks of `dtmega evaluate --task`: WikiText-style perplexity and LAMBADA accuracy."""
