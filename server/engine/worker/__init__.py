"""The runner: the one thread that owns the backend, its commands, clones, speculation, constrained rows, faults
and the step as data.

- runner.py: The runner: the one thread that owns the backend
- commands.py: The control loop's commands, as the runner thread runs them: a request's Start (a clone from
  the prefix cache, a session resumed, or an empty one), its Cancel or Finish, its Pause and Unpause (out of
  the batch and back, everything it holds kept), and the sessions the loop lets go (ReleaseSessions), spills
  to disk (Spill) and loads back (LoadState)
- cloning.py: The clones the runner thread takes of its running requests' sessions: a follower's, a capture's
  and a choice's
- speculation.py: Speculative decoding on the runner: how it verifies a drafter's guesses, and how long a
  draft may be
- constraints.py: Constrained rows on the runner: each holds a matcher, and its next mask is computed off the
  critical path
- sequence.py: A request in an inference slot, as the runner thread runs it: its session, its sampler, its
  progress through the prompt and the output, and its draft where it speculates
- clone_orders.py: Followers' clone orders, which the runner holds until their donors have committed enough
- faults.py: Faults stay where they start: a forward pass or a sampling call that fails, recovered from row by
  row, so a failure is charged to the request it belongs to and nothing committed is computed twice
  (base.BatchFailed is the backends' half of this contract)
- plan.py: The step as data: every backend effect of one runner step, as a plain value
- drafts.py: Model-free drafts for speculative decoding: prompt lookup and suffix decoding
"""
