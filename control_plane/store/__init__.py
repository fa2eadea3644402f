"""The job store: one SQLite file that survives a restart of the control plane.

``schema`` says what the rows are and migrates old files, ``db`` owns the connection and its
transactions, ``tables`` the per-job side tables, ``job_store`` the lifecycle API the services call.
"""
