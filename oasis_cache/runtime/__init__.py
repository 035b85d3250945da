"""What drives the model for a cache: its construction (`build.py`), what is installed on the model and given back
(`install.py`), the routed forward (`routing.py`), what a forward's layers share (`context.py`), captured and compiled
decode steps (`captured_step.py`, `replay.py`, `compiled_layers.py`), kernels compiled ahead (`ahead.py`)."""
