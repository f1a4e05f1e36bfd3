"""The word2vec example: skip-gram with negative sampling on a generated corpus with topic structure."""
