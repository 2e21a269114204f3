"""Who writes in a cluster: this process's role and its directories."""
