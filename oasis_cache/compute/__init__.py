"""The compute plane: the registered attention function, dense prefill attention, sparse decode attention, and the
plain references the tests check them against."""
