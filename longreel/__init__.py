"""longreel: long-video reasoning data curation and a GRPO trainer."""
__version__ = "0.1.0"
