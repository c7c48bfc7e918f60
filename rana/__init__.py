"""rana: RaNA adapters (rank + neuron allocation) for Hugging Face causal LMs."""
__version__ = "0.1.0"
