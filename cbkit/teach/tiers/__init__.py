"""The notebooks on the GPUs their users have: each notebook's sizes per tier (`table`, read by `setup`) and the
check that each fits and starts its CB engine there, without a GPU (`plan`, `cbkit tiers`)."""
