"""Where kvcompress plugs into the model library users run: ``transformers``, below the methods (which attach
to a model through it). Serving engines build on the methods instead, one layer up (``kvcompress.serving``)."""
