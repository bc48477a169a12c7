"""Adapters to the engines people already use; thin layers over :mod:`exl3rt.runtime`.

- :mod:`exl3rt.integrations.transformers`: ``from_pretrained(..., quantization_config=Exl3Config(bits=4))``.
  Import it explicitly (it imports transformers); ``exl3rt.Exl3Config`` also works with
  ``from_pretrained`` once transformers is imported (see that module's docstring).
"""
