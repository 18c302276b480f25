"""longalign: long-context supervised fine-tuning."""
