"""genq: generate completions for a whole data set on self-hosted SGLang servers."""
