"""Prediction over a data set: predict.py --out-dir's images/s beside its loader and its model alone
(the prediction rows of ./run bench.py)."""
