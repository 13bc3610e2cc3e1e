//! What a call runs ([`choose`]): the one place where the algorithm, the wire
//! format and the zero-fill of a call are decided, from the call, the job's
//! layout, its dedicated servers and the configuration, the same on every
//! rank (the descriptor check compares the outcome, so ranks configured
//! differently fail loudly instead of mixing).
//!
//! # The rules
//!
//! Each row is a rule [`choose`] follows (`M` machines of `D` ranks, `S`
//! dedicated servers; `ring` runs broadcasts and all-gathers as the relay and
//! reduce-scatters as the scatter algorithm); a test reads this table and
//! checks each row against the function, so the two cannot drift apart.
//! The measurements behind them follow.
//!
//! | collective | M | D | S | bytes | asked | dtype | wire | runs | wire runs | zero-fill |
//! |---|---|---|---|---|---|---|---|---|---|---|
//! | all-reduce | 2 | 1 | 0 | 256K | auto | i32 | exact | doubling | exact | no |
//! | all-reduce | 2 | 1 | 0 | 512K | auto | i32 | exact | hierarchical | exact | no |
//! | all-reduce | 3 | 1 | 0 | 4K | auto | i32 | exact | hierarchical | exact | no |
//! | all-reduce | 1 | 8 | 0 | 4K | auto | f32 | exact | hierarchical | exact | no |
//! | all-reduce | 2 | 1 | 0 | 4K | ring | i32 | exact | ring | exact | no |
//! | all-reduce | 2 | 1 | 0 | 4K | auto | f32 | bf16 | hierarchical | bf16 | no |
//! | all-reduce | 2 | 1 | 0 | 4K | doubling | f32 | bf16 | doubling | exact | no |
//! | all-reduce | 1 | 2 | 0 | 4K | auto | f32 | f16 | hierarchical | exact | no |
//! | all-reduce | 1 | 2 | 1 | 4K | auto | f32 | f16 | hierarchical | f16 | no |
//! | all-reduce | 2 | 2 | 0 | 4K | auto | i64 | bf16 | hierarchical | exact | no |
//! | broadcast | 2 | 1 | 0 | 4K | auto | u8 | exact | relay | exact | no |
//! | broadcast | 3 | 1 | 0 | 64M | auto | u8 | exact | relay | exact | no |
//! | broadcast | 4 | 1 | 0 | 4K | auto | u8 | exact | hierarchical | exact | yes |
//! | broadcast | 4 | 1 | 0 | 256K | auto | u8 | exact | relay | exact | no |
//! | broadcast | 2 | 2 | 0 | 4K | auto | u8 | exact | relay | exact | yes |
//! | broadcast | 2 | 2 | 1 | 4K | auto | u8 | exact | relay | exact | yes |
//! | broadcast | 2 | 2 | 1 | 4K | ring | u8 | exact | relay | exact | yes |
//! | broadcast | 1 | 2 | 1 | 4K | auto | u8 | exact | relay | exact | yes |
//! | all-gather | 1 | 2 | 1 | 4K | auto | u8 | exact | relay | exact | yes |
//! | all-gather | 4 | 2 | 2 | 4K | auto | u8 | exact | hierarchical | exact | yes |
//! | broadcast | 1 | 8 | 0 | 64M | auto | u8 | exact | hierarchical | exact | yes |
//! | all-gather | 2 | 2 | 0 | 4K | auto | u8 | exact | relay | exact | yes |
//! | all-gather | 8 | 1 | 0 | 4K | auto | u8 | exact | hierarchical | exact | yes |
//! | all-gather | 8 | 1 | 0 | 256K | hierarchical | u8 | exact | hierarchical | exact | yes |
//! | reduce-scatter | 1 | 8 | 0 | 4K | auto | i32 | exact | scatter | exact | no |
//! | reduce-scatter | 1 | 1 | 0 | 4K | auto | i32 | exact | hierarchical | exact | no |
//! | reduce-scatter | 2 | 1 | 0 | 4K | auto | i32 | exact | scatter | exact | no |
//! | reduce-scatter | 4 | 2 | 0 | 4K | auto | i32 | exact | hierarchical | exact | no |
//! | reduce-scatter | 4 | 2 | 0 | 256K | auto | i32 | exact | scatter | exact | no |
//! | reduce-scatter | 2 | 1 | 1 | 64M | auto | i32 | exact | scatter | exact | no |
//! | reduce-scatter | 2 | 2 | 2 | 64M | auto | i32 | exact | scatter | exact | no |
//! | all-reduce | 2 | 2 | 2 | 64M | auto | i32 | exact | hierarchical | exact | no |
//! | reduce-scatter | 2 | 1 | 0 | 64M | auto | f32 | bf16 | hierarchical | bf16 | no |
//! | reduce-scatter | 2 | 1 | 0 | 64M | ring | f32 | bf16 | scatter | exact | no |
//! | barrier | 2 | 2 | 0 | 1 | auto | u8 | exact | hierarchical | exact | no |
//!
//! In words:
//!
//! - **All-reduce**: hierarchical (through the dedicated servers, where the
//!   job has them), but recursive doubling on two machines of one device
//!   each up to 256 KiB without servers. A device all-reduce NCCL reduces
//!   (an exact wire, `auto`) runs as one NCCL all-reduce over the workers
//!   ([`Resolved::Nccl`]) where one can run and is ahead: on two to
//!   [`NCCL_ACROSS_UP_TO_MACHINES`] machines of several GPUs, at the sizes of
//!   [`nccl_across_job`], with or without dedicated servers (the windows
//!   are where NCCL is ahead of the plan without servers, which on the
//!   machines that make the job's communicator is ahead of the servers'
//!   own: `docs/scale-model.md`); on one machine of several GPUs beside
//!   dedicated servers, at every size (its NVLink, where the servers would
//!   take every byte over its NICs and back). The servers then plan the
//!   operation and serve none of it. Otherwise, beside dedicated servers, an
//!   exact all-reduce (not a reduce) runs as the same job without servers
//!   would ([`Resolved::Colocated`]: the machines serve its shards, the
//!   servers plan it and serve none of it) where the machines serve
//!   (`FAIRRING_MACHINES_SERVE`): `on` for every tensor, `auto` for device
//!   tensors where every worker's GPU reduces in its NVSwitch (the scale
//!   model's h100, whose servers are memory-bound where its machines are
//!   not); `off` never. The rules table is of host tensors under `auto`,
//!   where the servers serve. Without servers, on the flat plan in the
//!   default slices of 16 machines or more, an exact all-reduce (not a
//!   reduce) of a tensor the flat plan cuts into fewer than four slices,
//!   one of them giving fewer than three in four machines a shard (or the
//!   wide flat slices), runs in groups ([`Resolved::Grouped`],
//!   [`takes_groups`]); the rules table's jobs have no such groups.
//! - **Broadcast and all-gather**: relayed (the ring) on two or three
//!   machines, and on more from 256 KiB; hierarchical on one machine. A job
//!   with dedicated servers follows the same rule: its workers link their
//!   rails, and a relay takes no hop through a server; but on one machine of
//!   several ranks it relays too (the machine's reduce-scatter and
//!   all-gather), where hierarchical would go to the servers. Run as
//!   hierarchical's all-reduce, or relayed over the machines (a machine's
//!   ranks summed first), the callers' tensors need zeros where their own
//!   bytes are not (the zero-fill); relayed over the ranks they do not.
//! - **Reduce-scatter**: the scatter algorithm (the ring's reduce-scatter
//!   half) on one machine of several ranks, and where a broadcast would be
//!   relayed, with or without dedicated servers.
//! - **Gather, scatter and reduce** on host memory, of at least
//!   [`ROOTED_BY_MESSAGES_FROM`] bytes in all (the root's whole buffer) in a
//!   job of at most [`ROOTED_BY_MESSAGES_UP_TO`] ranks, move as messages after
//!   a check run as a barrier ([`rooted_by_messages`]): a gather's or a
//!   scatter's parts each once, between its rank and the root
//!   (`point_to_point::rooted`); a reduce's tensor once over each link of a
//!   chain of the ranks ending at the root (`point_to_point::chain`), where
//!   machines have one rank each (a machine's ranks reduce faster through its
//!   shared segment: measured below), but for `f16` and `bf16`, which the
//!   chain would round at every hop, and for `f32` where a compressed wire
//!   is asked for (the chain carries exact values). The check's descriptor
//!   says the call moves as messages, so a dedicated server plans the
//!   barrier. Smaller ones,
//!   those of larger jobs and those on device memory run as an all-gather, a
//!   broadcast of the root's whole input and an all-reduce: below the size,
//!   the check and the messages' hand-overs cost more than the bytes saved
//!   (measured below); in larger jobs a chain would be as long as the job
//!   (the bound of 32 ranks was set when each peer a root talked to cost it
//!   a two-rank communicator; it has not been measured again since messages
//!   became the engine's own).
//! - **Wire**: a compressed format applies to `f32` hierarchical calls that
//!   cross between machines straight to the machines serving them, or go to
//!   dedicated servers; elsewhere the call runs exact, as it does where the
//!   job's cells go through the trees or its slots are reduced in groups
//!   (`Routing::Trees`, `Routing::Groups`: rounding at every level is not the
//!   one rounding of the sum a compressed wire promises). Where a compressed wire applies and `auto` chose another
//!   algorithm, `auto` keeps hierarchical. A call that asks for a compressed
//!   wire for another type than `f32`, or for a collective that moves bytes
//!   without reducing them (broadcast, all-gather, barrier), is refused.
//!
//! # Measured crossovers
//!
//! `fairring-bench --local MxD --algo all`, f32 sum, 2-core VM, loopback tcp,
//! times in microseconds (hierarchical / ring), one sitting:
//!
//! | layout | 4 KiB | 64 KiB | 1 MiB | 4 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|---|---|
//! | 1x2 | 1.7 / 245 | 13.8 / 264 | 153 / 927 | 552 / 3915 | 4355 / 18047 | 16596 / 65068 |
//! | 1x3 | 120 / 509 | 188 / 629 | 1010 / 1980 | 2202 / 8932 | 8374 / 32490 | 34222 / 127227 |
//! | 2x1 | 228 / 253 | 262 / 274 | 870 / 1049 | 3969 / 4363 | 17920 / 18209 | 76209 / 73784 |
//! | 2x2 | 1194 / 2249 | 1497 / 2187 | 2763 / 3923 | 6656 / 12231 | 25295 / 46432 | 95820 / 184507 |
//! | 3x1 | 807 / 924 | 626 / 1000 | 2131 / 2349 | 8004 / 7935 | 37762 / 36441 | 127030 / 131531 |
//!
//! and, repeated at large sizes for one device per machine (two sittings each):
//!
//! | layout | 1 MiB | 4 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|
//! | 3x1 | 3262 / 3618 | 8253 / 7479 | 33994 / 37789 | 124498 / 113891 |
//! | 4x1 | 3070 / 4313 | 15395 / 14813 | 54594 / 54396 | |
//!
//! - With several devices per machine, hierarchical wins at every size, by 1.9x
//!   to 140x: its shared-memory step replaces `D - 1` fabric hops, and on one
//!   machine it never touches the fabric (the single-machine path).
//! - With one device per machine both move the same bytes per rank. Hierarchical
//!   wins below 4 MiB (2 hops instead of `2(M - 1)`: 1.1x to 1.6x); from 4 MiB the
//!   two are within the run-to-run spread (ring ahead by up to 10% in one
//!   sitting, behind by up to 10% in the next).
//!
//! Since the tcp fabric sends each driver pass's frames in one vectored write and
//! reads bursts in one read (and credits ride along), small operations cost
//! less under both; one sitting, same machine (hierarchical / ring):
//!
//! | layout | 4 KiB | 64 KiB | 1 MiB | 16 MiB |
//! |---|---|---|---|---|
//! | 2x1 | 48 / 56, 34 / 41, 48 / 49 | 71 / 73, 59 / 49, 63 / 73 | 483 / 489 | 10605 / 10151 |
//! | 3x1 | 116 / 179 | 153 / 225 | 560 / 657 | 18802 / 19171 |
//!
//! (three runs at 2x1 for the small sizes, whose ring times are bimodal on two
//! cores). The ring's two simultaneous hops tie hierarchical's two at 2x1;
//! from 3x1 its `2(M - 1)` hops lose.
//!
//! Ring was never faster beyond that spread. Where the two tie `auto` keeps
//! hierarchical.
//!
//! **Recursive doubling** ([`Algorithm::Doubling`]) exchanges the whole slice
//! with one partner per round: at 2x1 that is one hop where the others take two.
//! `fairring-bench --local MxD --algo all --min-bytes 4K --max-bytes 1M --factor
//! 4`, one sitting, times in microseconds (hierarchical / ring / doubling), two
//! runs each:
//!
//! | layout | 4 KiB | 16 KiB | 64 KiB | 256 KiB | 1 MiB |
//! |---|---|---|---|---|---|
//! | 2x1 | 38 / 20 / 11, 61 / 68 / 35 | 38 / 32 / 13, 63 / 66 / 47 | 56 / 47 / 53, 79 / 59 / 61 | 109 / 135 / 77, 138 / 138 / 87 | 478 / 469 / 435, 457 / 472 / 447 |
//! | 3x1 | 127 / 193 / 113, 120 / 198 / 144 | 132 / 213 / 109, 126 / 186 / 134 | 141 / 201 / 128, 145 / 192 / 130 | 396 / 377 / 283, 264 / 356 / 282 | 806 / 903 / 1212, 725 / 860 / 1120 |
//!
//! and over six alternating runs at 2x1, 4 KiB, medians of 41 (doubling), 51
//! (hierarchical) and 61 us (ring). Since a spinning thread moves large tcp
//! transfers itself, in writes of at most 256 KiB, hierarchical's two hops
//! of half the slice beat doubling's one of the whole from 512 KiB; medians
//! of five runs, same command to 2 MiB, factor 2 (hierarchical / ring /
//! doubling):
//!
//! | layout | 64 KiB | 128 KiB | 256 KiB | 512 KiB | 1 MiB | 2 MiB |
//! |---|---|---|---|---|---|---|
//! | 2x1 | 28 / 22 / 21 | 38 / 38 / 33 | 54 / 53 / 55 | 90 / 90 / 110 | 178 / 189 / 221 | 414 / 410 / 540 |
//!
//! So `auto` runs doubling on two machines of one device each up to 256 KiB.
//! At 3x1 (an extra rank folds in and out: three
//! hops) doubling ties hierarchical up to 256 KiB and loses at 1 MiB; `auto`
//! keeps hierarchical. From four ranks these two cores are oversubscribed and
//! measure the scheduler more than the hops (doubling lost at 4x1 by 1.1x to
//! 2x); more machines wait for a machine with the cores to measure them. The
//! rule lives here, next to its evidence: a layout measured adds a row and a
//! branch.

//! # Broadcast and all-gather
//!
//! Ring runs them as a relay (each byte sent once per hop, `M - 1` hops one
//! after another); hierarchical as all-reduces (each byte sent twice, in two
//! hops). `fairring-bench --collective broadcast|all_gather --algo all`, 2-core
//! VM, loopback tcp, times in microseconds (hierarchical / relay), one sitting
//! each:
//!
//! | layout | 4 KiB | 64 KiB | 256 KiB | 1 MiB | 4 MiB | 64 MiB |
//! |---|---|---|---|---|---|---|
//! | 2x1 broadcast | 90 / 72 (8 KiB) | 108 / 93 | 230 / 214 (512 KiB) | | 1940 / 1642 | 43030 / 14984 |
//! | 2x1 all-gather | 73 / 69 (8 KiB) | 88 / 78 | 227 / 194 (512 KiB) | | 2029 / 1175 | 45234 / 22882 |
//! | 3x1 broadcast | 344 / 291 (3 KiB) | 326 / 243 (48 KiB) | 803 / 703 (768 KiB) | | 13546 / 7124 (12 MiB) | 54877 / 22323 (48 MiB) |
//! | 4x1 broadcast | 460 / 516 | 562 / 532 | 831 / 679 | 1620 / 1625 | 7418 / 4478 | |
//! | 4x1 all-gather | 517 / 548 | 461 / 391 | 766 / 576 | 1786 / 1459 | 7045 / 4489 | |
//! | 2x2 broadcast (relay over every rank) | 398 / 287 (3 KiB) | 331 / 284 (48 KiB) | 659 / 1119 (768 KiB) | | 12990 / 11472 (12 MiB) | 44999 / 36662 (48 MiB) |
//!
//! - With one device per machine the relay moves half the bytes and wins from
//!   256 KiB by 1.1x to 2.9x. Below that the two are within this machine's
//!   noise; the relay takes `M - 1` hops one after another where hierarchical
//!   takes two, so from four machines on `auto` keeps hierarchical for small
//!   operations (a bound reasoned from the hops, not yet measured where the
//!   hops, not the cores, are the cost).
//! - With several devices per machine the relay runs around the machines, one
//!   chain per rail, with shared memory inside each (`algorithm/relay.rs`).
//!   2x2, same command with `--factor 4 --iters 5`, two sittings, times in
//!   microseconds (hierarchical / relay):
//!
//! | 2x2 | 4 KiB | 64 KiB | 1 MiB | 4 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|---|---|
//! | broadcast | 310 / 222, 291 / 275 | 354 / 292, 344 / 254 | 737 / 713, 758 / 1524 | 3981 / 3078, 3152 / 3992 | 17039 / 14961, 17294 / 12882 | 61870 / 52063, 64487 / 49415 |
//! | all-gather | 290 / 255, 310 / 258 | 306 / 254, 367 / 265 | 863 / 604, 827 / 629 | 3451 / 3496, 3884 / 3471 | 19990 / 17092, 16193 / 14628 | 67317 / 53166, 62764 / 53452 |
//!
//!   The relay wins from 16 MiB by 1.1x to 1.3x and mostly below; `auto`
//!   relays on several devices per machine by the rule above. On one machine
//!   there is no hop between machines, and hierarchical's single-machine path
//!   copies less: `auto` keeps it. A job with dedicated servers relays by
//!   the same rule (measured below, under **With dedicated servers**).
//!
//! # Reduce-scatter
//!
//! Ring runs it as the ring's reduce-scatter half over the same range of every
//! rank's share, once per byte: around the ranks where machines have one
//! device (`(N-1)/N` of the input leaves each rank), around the machines along
//! each rail after the machine's own reduce-scatter where they have several
//! (`(M-1)/M` of each rank's slot, `1/D` of the input, leaves it; on one
//! machine, the machine's reduce-scatter alone). Hierarchical and doubling run
//! an all-reduce of the whole input. `fairring-bench --collective
//! reduce_scatter --algo all --min-bytes 4K --max-bytes 64M --factor 16 --iters
//! 5`, 2-core VM, loopback tcp, times in microseconds (hierarchical / ring /
//! doubling), one sitting per group of rows:
//!
//! | layout | 4 KiB | 64 KiB | 1 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|---|
//! | 2x1 | 64 / 36 / 34 | 91 / 82 / 75 | 516 / 280 / 370 | 11715 / 6761 / 13345 | 46154 / 29567 / 49688 |
//! | 3x1 | 147 / 168 / 132 | 190 / 167 / 139 | 832 / 640 / 1020 | 22695 / 14054 / 23260 | 77898 / 47813 / 83782 |
//! | 4x1 | 264 / 306 / 207 | 282 / 357 / 385 | 1448 / 1369 / 1870 | 27823 / 21854 / 41476 | 108658 / 62251 / 150217 |
//! | 1x2 | 26 / 21 / | 47 / 26 / | 77 / 60 / | 3042 / 2025 / | 13000 / 8353 / |
//! | 1x3 | 86 / 97 / | 108 / 88 / | 224 / 160 / | 5969 / 3673 / | 22173 / 13780 / |
//! | 2x2 | 178 / 167 / | 219 / 208 / | 821 / 852 / | 15374 / 10343 / | 57950 / 36946 / |
//!
//! The ring wins from 16 MiB by 1.5x to 1.8x everywhere, and from 1 MiB where
//! machines have one device. Below that it ties at two and three machines; at
//! four it takes `M - 1` hops where hierarchical takes two, and loses at 64 KiB
//! and below. So `auto` follows the relay's rule on several machines (the ring
//! on two or three, and from 256 KiB), and runs the ring on one machine of
//! several ranks, where it is hierarchical's reduce-scatter without the
//! all-gather. A job with dedicated servers follows the same rule (measured
//! below, under **With dedicated servers**).
//!
//! **With dedicated servers.** Every job links its rails, so a job with
//! dedicated servers relays, scatters and chooses between them and
//! hierarchical by the rules above (but for the wire's rule: where a
//! compressed wire is asked for and applies, `auto` keeps hierarchical,
//! which on one machine beside servers goes to them). Before its workers
//! linked their rails, such a job ran the broadcasts and all-gathers of
//! machines of several devices, and every reduce-scatter, through the
//! servers (hierarchical).
//! `fairring-bench --local MxD --servers K --collective C --iters 10`
//! (`--iters 50` at 64 KiB), 2-core VM, loopback tcp, f32, medians of three
//! sittings (seven at 64 KiB on 2x2, five at 64 KiB elsewhere), each the
//! two builds in turn, times in microseconds (through the servers / by
//! these rules):
//!
//! | layout | collective | 64 KiB | 1 MiB | 16 MiB |
//! |---|---|---|---|---|
//! | 2x2 + 2 | broadcast | 411.6 / 162.2 | 1452.4 / 819.5 | 32619.5 / 19224.6 |
//! | 2x2 + 2 | all-gather | 209.6 / 175.1 | 1288.7 / 1071.5 | 36397.8 / 19654.6 |
//! | 2x2 + 2 | reduce-scatter | 302.7 / 209.1 | 1232.2 / 645.3 | 34183.2 / 14645.1 |
//! | 2x2 + 2 | all-reduce | 262.2 / 264.7 | 1583.2 / 1318.4 | 32865.7 / 32582.9 |
//! | 2x1 + 2 | reduce-scatter | 93.4 / 22.6 | 770.5 / 305.8 | 23585.7 / 8704.5 |
//! | 1x2 + 1 | reduce-scatter | 83.1 / 28.0 | 736.7 / 100.8 | 17720.5 / 2520.1 |
//! | 1x2 + 1 | broadcast | 68.0 / 30.9 | 791.8 / 172.5 | 20492.2 / 5636.4 |
//! | 1x2 + 1 | all-gather | 82.1 / 31.5 | 915.0 / 280.4 | 21319.2 / 6218.8 |
//! | 3x2 + 2 | all-reduce | 532.7 / 478.6 | 2559.3 / 2641.5 | |
//!
//! By these rules broadcasts, all-gathers and reduce-scatters take 1.2x to
//! 7x less time, at 64 KiB too, the servers moving none of their bytes;
//! all-reduces, which still go to the servers (each descriptor also going
//! along the rails), take no longer within the spread of these cores (0.97x
//! to 1.2x the time before; 3x2 + 2, at 1 MiB, five sittings, and 64 KiB,
//! seven).
//!
//! **Gathers and scatters as messages.** `fairring-bench --collective
//! gather|scatter --iters 20`, 2-core VM, loopback tcp, the size being the
//! root's whole buffer, times in microseconds (as an all-gather or a broadcast
//! of the whole buffer / as messages), one sitting:
//!
//! | layout | 64 KiB | 256 KiB | 1 MiB | 4 MiB | 64 MiB |
//! |---|---|---|---|---|---|
//! | 2x1 gather | 14 / 55 | 340 / 67 | 318 / 330 | 1810 / 956 | 30421 / 17221 |
//! | 2x1 scatter | 17 / 81 | 39 / 108 | 425 / 350 | 1339 / 1058 | 30594 / 17211 |
//! | 3x1 gather | 66 / 187 | 303 / 270 | 739 / 576 | 3005 / 1384 | 50944 / 22060 |
//! | 3x1 scatter | 75 / 95 | 336 / 112 | 754 / 632 | 3079 / 1257 | 51953 / 18646 |
//! | 1x3 gather | 36 / 739 | 95 / 203 | 562 / 793 | 2187 / 1510 | 44725 / 20361 |
//! | 1x3 scatter | 34 / 453 | 85 / 489 | 484 / 566 | 2228 / 1222 | 46937 / 17132 |
//!
//! Messages move half the bytes or less and win from 4 MiB everywhere (1.3x to
//! 2.7x); below 1 MiB the check, the gate's hand-over and each message's
//! own cost more than they save, most on one machine, where the all-gather
//! never touches the fabric. So they run from 2 MiB.
//!
//! A reduce, the same way (`--collective reduce --iters 10`; as an all-reduce /
//! as a chain), one sitting:
//!
//! | layout | 1 MiB | 4 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|
//! | 2x1 | 851 / 755 | 3148 / 2217 | 16964 / 7425 | 70227 / 36686 |
//! | 3x1 | 1557 / 1464 | 6973 / 5404 | 30101 / 19438 | 123080 / 72374 |
//! | 4x1 | 2049 / 2004 | 10507 / 7593 | 47091 / 30771 | 179343 / 107776 |
//! | 1x3 | 581 / 558 | 2593 / 5593 | 11074 / 19974 | 48515 / 77489 |
//! | 2x2 | 1491 / 1386 | 5416 / 7409 | 26398 / 29886 | 105369 / 122665 |
//!
//! Between machines of one rank the chain wins from 4 MiB (1.3x to 2.3x) and
//! ties at 1 MiB; where a machine has several ranks the shared-memory
//! all-reduce wins from 4 MiB (by 1.1x to 2.2x), so the chain runs only
//! where machines have one rank each.

use fairring_core::plan::{Geometry, Routing};
use fairring_core::topology::Topology;
use fairring_core::{DataType, ReduceOp, WireFormat};

use super::algorithm::{Resolved, relay_over_machines};
use super::descriptor::Collective;
use super::layout::takes_groups;
use crate::config::{Algorithm, MachinesServe};
use crate::error::{Error, Result};
use crate::memory::MemoryKind;

/// A call, as the choice sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    pub(crate) collective: Collective,
    /// The element type it reduces (bytes, `u8`, for what it only moves).
    pub(crate) dtype: DataType,
    /// Its whole tensor: an all-reduce's, a broadcast's, an all-gather's
    /// output, a reduce-scatter's input.
    pub(crate) bytes: u64,
    /// What the call asks for, over the job's configuration.
    pub(crate) algorithm: Option<Algorithm>,
    pub(crate) wire: Option<WireFormat>,
    /// Its operator (a sum for what it only moves) and where its tensor is.
    pub(crate) op: ReduceOp,
    pub(crate) memory: MemoryKind,
}

/// The job, as the choice sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Job {
    pub(crate) topology: Topology,
    /// Dedicated reduction servers.
    pub(crate) servers: u32,
    /// How the hierarchical all-reduce's cells travel between machines (its
    /// geometry's).
    pub(crate) routing: Routing,
    /// The configured algorithm and wire format.
    pub(crate) algorithm: Algorithm,
    pub(crate) wire: WireFormat,
    /// Whether one NCCL all-reduce can reduce a device tensor over every
    /// worker of the job: the job's communicator was made (two to
    /// [`NCCL_ACROSS_UP_TO_MACHINES`] machines of several ranks, with or
    /// without dedicated servers), or the job's workers are one machine
    /// beside dedicated servers and the machine's communicators were made.
    pub(crate) nccl_over_workers: bool,
    /// Beside dedicated servers: whether the machines serve an all-reduce
    /// the servers would take ([`Resolved::Colocated`]), as configured
    /// (`FAIRRING_MACHINES_SERVE`)...
    pub(crate) machines_serve: MachinesServe,
    /// ...whether every worker's GPU reduces in its NVSwitch and the
    /// machines' ranks reduce through NCCL (settled alike on every rank when
    /// its device side was made), for `auto`...
    pub(crate) gpus_in_switch: bool,
    /// ...and whether the job plans without servers at all (the engine has
    /// the machines' own geometry).
    pub(crate) machines_can_serve: bool,
    /// On the flat plan, where its small tensors plan in groups
    /// ([`Resolved::Grouped`]): the job's flat geometry, whose cut of a
    /// tensor decides ([`takes_groups`]).
    pub(crate) groups_for_small_tensors: Option<Geometry>,
}

/// What a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Choice {
    pub(crate) algorithm: Resolved,
    /// The wire format between machines.
    pub(crate) wire: WireFormat,
    /// Whether a broadcast's or an all-gather's callers zero their tensors
    /// where their own bytes are not (see the module docs).
    pub(crate) zero_fill: bool,
}

/// Refuses a compressed `wire` for `collective`, which moves bytes exactly.
pub(crate) fn check_moves_exactly(collective: Collective, wire: Option<WireFormat>) -> Result<()> {
    match wire {
        Some(w) if w != WireFormat::Exact => Err(Error::invalid(
            "wire",
            format!(
                "a {} moves bytes exactly: the {w} wire applies to all-reduces, reduces and \
                 reduce-scatters of f32",
                collective.name()
            ),
        )),
        _ => Ok(()),
    }
}

/// The most ranks of a job whose gathers and scatters on host memory move
/// their parts as messages (see the module docs).
pub(crate) const ROOTED_BY_MESSAGES_UP_TO: u32 = 32;

/// The fewest bytes in all (every rank's part) of a gather or a scatter that
/// moves as messages (see the module docs).
pub(crate) const ROOTED_BY_MESSAGES_FROM: u64 = 2 << 20;

/// Whether a `collective` of `dtype` on `memory` of `bytes` in all (every
/// rank's part; a reduce's tensor), asking for `wire`, in a job of
/// `topology`, moves as messages after a check (see the module docs): the
/// same on every rank (the check's descriptor says so, for a dedicated
/// server).
pub(crate) fn rooted_by_messages(
    collective: Collective,
    dtype: DataType,
    memory: MemoryKind,
    wire: WireFormat,
    topology: Topology,
    bytes: u64,
) -> bool {
    let moves = match collective {
        Collective::Gather | Collective::Scatter => true,
        // A machine's ranks reduce through its shared segment faster than a
        // chain's messages between them; a chain would round halves at
        // every hop, and carries no compressed wire.
        Collective::Reduce => {
            topology.machines() >= 2
                && topology.devices_per_machine() == 1
                && !matches!(dtype, DataType::F16 | DataType::BF16)
                && !(wire != WireFormat::Exact && dtype == DataType::F32)
        }
        _ => false,
    };
    moves
        && memory == MemoryKind::Host
        && topology.world_size() <= ROOTED_BY_MESSAGES_UP_TO
        && bytes >= ROOTED_BY_MESSAGES_FROM
}

/// What `call` runs in `job` (see the module docs); an error where the call
/// asks for what cannot run (a compressed wire for another type than `f32`).
pub(crate) fn choose(call: Call, job: &Job) -> Result<Choice> {
    // A reduce, a gather and a scatter run as their engine form (the name
    // in an error stays the call's).
    let form = call.collective.engine_form();
    let reduces = matches!(form, Collective::AllReduce | Collective::ReduceScatter);
    if !reduces {
        check_moves_exactly(call.collective, call.wire)?;
    }
    if let Some(wire) = call.wire
        && !wire.carries(call.dtype)
    {
        return Err(Error::invalid(
            "wire",
            format!(
                "the {wire} wire carries f32 values only, not {}: an integer or \
                 half-precision all-reduce runs exact",
                call.dtype
            ),
        ));
    }
    let asked = call.algorithm.unwrap_or(job.algorithm);
    let requested_wire = call.wire.unwrap_or(job.wire);
    let mut algorithm = resolve(form, asked, call.bytes, job)?;
    // A device all-reduce NCCL's collectives take, where one NCCL
    // all-reduce over the workers is ahead of the plan, runs as that, exact.
    if asked == Algorithm::Auto
        && call.collective == Collective::AllReduce
        && call.memory == MemoryKind::Device
        && job.nccl_over_workers
        && requested_wire == WireFormat::Exact
        && crate::local::takes(call.dtype, call.op)
        && nccl_ahead(job, call.bytes)
    {
        algorithm = Resolved::Nccl;
    }
    // Beside dedicated servers, an all-reduce the servers would take runs
    // as the same job without them would where the machines out-reduce the
    // servers, exact.
    if asked == Algorithm::Auto
        && algorithm == Resolved::Hierarchical
        && call.collective == Collective::AllReduce
        && job.servers > 0
        && requested_wire == WireFormat::Exact
        && machines_serve(job, call.memory)
    {
        algorithm = Resolved::Colocated;
    }
    // On the flat plan, an exact all-reduce of a tensor the flat plan cuts
    // into too few slices, or into slices that leave machines without a
    // shard, runs in groups.
    if asked == Algorithm::Auto
        && algorithm == Resolved::Hierarchical
        && call.collective == Collective::AllReduce
        && requested_wire == WireFormat::Exact
        && let Some(flat) = job.groups_for_small_tensors
        && takes_groups(&flat, call.dtype, call.bytes / call.dtype.size_bytes())
    {
        algorithm = Resolved::Grouped;
    }
    // Values cross compressed to dedicated servers, or straight to the
    // machines serving them; through the trees and in groups (of machines or
    // of servers) they cross exact.
    let compresses =
        job.routing == Routing::Flat && (job.servers > 0 || job.topology.machines() > 1);
    // Only the hierarchical algorithm compresses: `auto` keeps it where a
    // compressed wire is asked for and would apply.
    if requested_wire != WireFormat::Exact
        && call.dtype == DataType::F32
        && algorithm != Resolved::Hierarchical
        && asked == Algorithm::Auto
        && compresses
    {
        algorithm = Resolved::Hierarchical;
    }
    let wire = if call.dtype == DataType::F32 && algorithm == Resolved::Hierarchical && compresses {
        requested_wire
    } else {
        WireFormat::Exact
    };
    let spread = matches!(form, Collective::Broadcast | Collective::AllGather);
    let zero_fill =
        spread && (algorithm != Resolved::Relay || relay_over_machines(job.topology, form));
    Ok(Choice {
        algorithm,
        wire,
        zero_fill,
    })
}

/// The algorithm a `collective` of `bytes` runs where `asked` is asked for,
/// `auto` resolved: broadcasts and all-gathers run the relay where the ring
/// is chosen, and reduce-scatters the scatter algorithm.
fn resolve(collective: Collective, asked: Algorithm, bytes: u64, job: &Job) -> Result<Resolved> {
    let topology = job.topology;
    let spread = matches!(collective, Collective::Broadcast | Collective::AllGather);
    let scatter = collective == Collective::ReduceScatter;
    let concrete = match asked {
        Algorithm::Auto => {
            if spread && job.servers > 0 && topology.machines() == 1 {
                // One machine beside servers: hierarchical would send every
                // byte to the servers and back, where the relay stays in
                // the machine (its reduce-scatter and all-gather).
                if relay_over_machines(topology, collective) {
                    Algorithm::Ring
                } else {
                    Algorithm::Hierarchical
                }
            } else if spread {
                auto_spread(topology, bytes)
            } else if scatter {
                auto_scatter(topology, bytes)
            } else if job.servers > 0 {
                // A job with dedicated servers keeps them serving its
                // all-reduces (but see the rules for NCCL's and the
                // machines' own plan in `choose`).
                Algorithm::Hierarchical
            } else {
                auto_all_reduce(topology, bytes)
            }
        }
        concrete => concrete,
    };
    match Resolved::of(concrete) {
        Some(Resolved::Ring) if spread => Ok(Resolved::Relay),
        Some(Resolved::Ring) if scatter => Ok(Resolved::Scatter),
        Some(resolved) => Ok(resolved),
        None => Err(Error::internal(
            "auto resolves to a concrete algorithm",
            format!("{asked} on {topology:?} for {bytes} bytes"),
        )),
    }
}

/// Whether the machines of `job`, which has dedicated servers, serve an
/// all-reduce of a tensor in `memory` themselves (`FAIRRING_MACHINES_SERVE`):
/// `on`, or under `auto` a device tensor where every GPU reduces in its
/// NVSwitch.
fn machines_serve(job: &Job, memory: MemoryKind) -> bool {
    job.machines_can_serve
        && match job.machines_serve {
            MachinesServe::On => true,
            MachinesServe::Auto => memory == MemoryKind::Device && job.gpus_in_switch,
            MachinesServe::Off => false,
        }
}

/// What `auto` runs for an all-reduce of `bytes` on `topology`.
fn auto_all_reduce(topology: Topology, bytes: u64) -> Algorithm {
    if topology.machines() == 2
        && topology.devices_per_machine() == 1
        && bytes <= DOUBLING_UP_TO_BYTES
    {
        Algorithm::Doubling
    } else {
        Algorithm::Hierarchical
    }
}

/// What `auto` runs for a broadcast or an all-gather of `bytes` (its whole
/// output) on `topology`: [`Algorithm::Ring`] runs them as a relay, which
/// moves each byte once per hop instead of twice (around the machines, with
/// shared memory inside each, where a machine has several devices).
fn auto_spread(topology: Topology, bytes: u64) -> Algorithm {
    let machines = topology.machines();
    if machines > 1 && (machines <= 3 || bytes >= RELAY_FROM_BYTES) {
        Algorithm::Ring
    } else {
        Algorithm::Hierarchical
    }
}

/// What `auto` runs for a reduce-scatter of `bytes` (its whole input) on
/// `topology`: [`Algorithm::Ring`] runs it as the ring's reduce-scatter half,
/// which moves half the bytes of an all-reduce.
fn auto_scatter(topology: Topology, bytes: u64) -> Algorithm {
    if topology.machines() == 1 && topology.devices_per_machine() > 1 {
        // One machine: its reduce-scatter alone, without the all-gather.
        Algorithm::Ring
    } else {
        auto_spread(topology, bytes)
    }
}

/// Whether one NCCL all-reduce over the workers is ahead of the plan for a
/// device all-reduce of `bytes` in `job`: across few machines where the scale
/// model says so ([`nccl_across_job`]; beside dedicated servers too, which it
/// then leaves idle: on the machines it is ahead of the plan without servers,
/// it is ahead of the servers' own), and at every size on one machine of
/// several ranks beside dedicated servers (the machine's NVLink, where the
/// plan would send every byte to the servers and back over its NICs).
fn nccl_ahead(job: &Job, bytes: u64) -> bool {
    nccl_beside_servers(job.topology, job.servers)
        || nccl_across_job(job.topology.machines(), bytes)
}

/// Whether a job of `topology` with `servers` dedicated servers runs its
/// device all-reduces that NCCL reduces (`auto`, exact) as one NCCL
/// all-reduce on the machine's communicators beside the servers, which
/// serve none of them: its workers are one machine of several ranks, and
/// it has servers.
pub fn nccl_beside_servers(topology: Topology, servers: u32) -> bool {
    servers > 0 && topology.machines() == 1 && topology.devices_per_machine() > 1
}

/// Whether a job of `topology` with `servers` dedicated servers may run a
/// device all-reduce as one NCCL all-reduce over its workers, at some size:
/// on one machine beside servers ([`nccl_beside_servers`]), or across
/// machines ([`nccl_across_job_may_run`]). A dedicated server accepts such an
/// operation there and plans it without serving it, and nowhere else
/// (`engine/serving.rs`): elsewhere a step between machines would pass
/// unserved.
pub(crate) fn nccl_over_workers_may_run(topology: Topology, servers: u32) -> bool {
    nccl_beside_servers(topology, servers) || nccl_across_job_may_run(topology)
}

/// The most machines on which `auto` may run a device all-reduce as one NCCL
/// all-reduce across the job ([`nccl_across_job`]).
pub const NCCL_ACROSS_UP_TO_MACHINES: u32 = 7;

/// Whether the job's NCCL communicator may be made, for device all-reduces
/// that run as one NCCL all-reduce across the job at some size: two to
/// [`NCCL_ACROSS_UP_TO_MACHINES`] machines of several ranks each, with or
/// without dedicated servers (the workers confirm each other's descriptors
/// along their rails, which every job links, before the call combines their
/// bytes). Where not, no rank makes the job's communicator.
pub(crate) fn nccl_across_job_may_run(topology: Topology) -> bool {
    (2..=NCCL_ACROSS_UP_TO_MACHINES).contains(&topology.machines())
        && topology.devices_per_machine() > 1
}

/// Whether `auto` runs a device all-reduce of `bytes` on `machines` machines
/// as one NCCL all-reduce across the job, where the job's communicator was
/// made (GPUs that reduce in their NVSwitch, `FAIRRING_NCCL_ACROSS_MACHINES`).
///
/// The sizes are where the scale model (`docs/scale-model.md`, the h100
/// preset) puts NCCL's all-reduce as its tuner picks it ahead of the plan.
/// The call is ungated (`memory::program::ungated`), so it costs NCCL's time
/// alone. The sizes were probed every 4 KiB below 1 MiB, every 64 KiB to 320
/// MiB and every MiB to 2 GiB; each window ends at the last size probed
/// ahead (`NCCL_ACROSS_WINDOWS_KIB`). Small all-reduces run NCCL's tree
/// (its latency is below the plan's); from a few MiB NVLSTree reduces within
/// each machine in the NVSwitch, which moves each byte over a GPU's links
/// once where the plan's reduce-scatter and all-gather move it twice, so it
/// is ahead where NVLink bounds the plan: few machines, up to a hundred MiB
/// or so past two, and on two machines at every size from 2.25 MiB.
pub fn nccl_across_job(machines: u32, bytes: u64) -> bool {
    let Some(windows) = machines
        .checked_sub(2)
        .and_then(|i| NCCL_ACROSS_WINDOWS_KIB.get(i as usize))
    else {
        return false;
    };
    windows
        .iter()
        .any(|&(from, to)| (from << 10..=to.saturating_mul(1 << 10)).contains(&bytes))
}

/// Per machine count from two to [`NCCL_ACROSS_UP_TO_MACHINES`], the sizes
/// (KiB, inclusive) at which [`nccl_across_job`] runs NCCL: the scale
/// model's windows where NCCL's all-reduce is ahead of the plan.
const NCCL_ACROSS_WINDOWS_KIB: [&[(u64, u64)]; 6] = [
    &[(0, 196), (676, 1020), (2304, u64::MAX)],
    &[(0, 124), (840, 1020), (2368, 241_088), (256_000, 262_720)],
    &[(0, 72), (10_688, 124_992), (128_064, 135_936)],
    &[
        (0, 80),
        (10_112, 48_640),
        (49_216, 59_264),
        (71_872, 113_280),
        (128_064, 134_208),
    ],
    &[(0, 84), (9_792, 113_152), (130_496, 133_120)],
    &[
        (0, 88),
        (840, 1020),
        (9_536, 116_928),
        (128_896, 128_960),
        (131_328, 131_520),
        (131_712, 136_576),
        (137_472, 139_968),
    ],
];

/// Largest all-reduce `auto` runs by recursive doubling (on two machines of one
/// device each).
const DOUBLING_UP_TO_BYTES: u64 = 256 << 10;

/// Smallest broadcast or all-gather that `auto` relays on four or more
/// machines (on two or three the relay takes no more hops than hierarchical).
const RELAY_FROM_BYTES: u64 = 256 * 1024;

#[cfg(test)]
mod tests;
