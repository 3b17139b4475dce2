"""Problems and their scoring: GSM8K and word problems, answer extraction, rewards."""
