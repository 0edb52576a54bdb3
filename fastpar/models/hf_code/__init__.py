"""Hugging Face model code that ``python -m fastpar.export`` copies into an exported directory,
for the models no transformers family expresses (``fastpar.models.gpt_code``).

These files import torch and transformers only, never fastpar: transformers loads them from the
exported directory (``from_pretrained(dir, trust_remote_code=True)``), where fastpar may not be
installed. fastpar itself imports them only in the exporter (which needs the hf extra).
"""
