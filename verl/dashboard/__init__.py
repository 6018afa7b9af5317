"""Live web dashboard over ``verl_logs.jsonl``: ``verl dashboard --log_dir RUN [RUN2 ...] --port 8265``.

A FastAPI app (``verl.dashboard.app.create_app``) serving a static page that plots reward, KL, losses, response
length, throughput and eval accuracy for several runs overlaid, refreshing while they train, with the latest sampled
generations and alerts. The chart library (uPlot, MIT) ships in ``static/``: the page needs no network access.
"""
