"""What drives the model for a cache: what is installed on the model and given back (`install.py`)."""
