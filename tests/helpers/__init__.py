"""What several test modules share, each helper module named for what it holds; no test module imports another."""
