"""Prediction over a whole data set: plan, score each rank's share, file by shard, write parts, join
(predict.py and wds-predict)."""
