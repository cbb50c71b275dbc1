"""Rescue as a service: a folder queue of studies, a long-running worker and its HTTP API.

`queue` is the job folder layout and the read/write side of the queue (no
runtime imports); `settings` is what a job may choose (the service's own
configuration, the job-settable keys); `job` runs one job in a child process
through the study library; `worker` is `rescue serve`; `api` is its aiohttp
application.
"""
