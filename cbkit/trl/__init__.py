"""The bridge onto TRL's trainers: config mapping, reward adapter, trainers that keep CB logprobs."""
