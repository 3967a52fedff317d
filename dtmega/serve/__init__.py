"""`dtmega serve`: continuous-batching text generation behind Megatron's and OpenAI's HTTP APIs."""
