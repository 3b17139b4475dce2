"""The notebooks on T4 and A100 GPUs: their sizes per tier (`table`) and the check that each fits there (`plan`)."""
