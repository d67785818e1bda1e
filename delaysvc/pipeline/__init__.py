"""The data pipeline on Spark (PySpark): bulk scheduling and archiving, as extract /
transform / load functions. `local[*]` by default; any cluster with `--master`."""
