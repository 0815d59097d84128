"""PD retraction on a DeepSeek-V4 decode: the prefill recompute goes to the bound prefill DP rank."""
