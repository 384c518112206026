"""The tiny models built offline for the demo and the tests (shipped in models/): a chat LM, a tool
model and a reward model, each recorded by its spec."""
