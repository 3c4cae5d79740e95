"""Evaluation: metrics with paired bootstrap CIs, `dgr2 eval`, non-LM baselines, the decode-speed harness and the SID-copy diagnostic."""
