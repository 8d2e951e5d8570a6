"""``tether demo``: a document pipeline that crashes, resumes and asks a person.

``documents`` holds the bundled samples, ``pipeline`` the App (its workflow,
activities and the offline model), ``run`` the terminal program that drives it:
it starts a worker process, kills it part-way, starts another, asks for the
reviews, and checks its own outcome against a side table of executions.
"""
